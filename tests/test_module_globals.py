"""The switchboard rule (docs/settings.md): no module global of te_dist or cutlass_kernels is changed from
outside its module, in te_dist/ and tests/ (benchmarks/: tests/test_benchmarks.py, stricter still).

A switch or knob is a field of ``te_dist.settings``; a module's own state changes through a function of
that module (``te_dist.quantization.compile.forget_compiled``, ``consensus.use_side_group_on_gloo``).
Tests may still stand a test double in for a function or class (a spy, a fake library: the global holds
code, or the value written is a lambda or a function or class the test defines); te_dist/ itself
replaces nothing of another module. Nothing is run but imports."""

from __future__ import annotations

import builtins
import types

from module_globals import ROOT, UNKNOWN, resolve, static_kind, writes

OURS = ("te_dist", "cutlass_kernels")
VENDORED = ("upstream",)  # Megatron-Core's own test suites, copied under tests/megatron/


def _files(folder: str):
    return sorted(p for p in (ROOT / folder).rglob("*.py")
                  if not any(part.startswith(VENDORED) for part in p.relative_to(ROOT).parts))


def _kind(owner_path: str, name: str) -> str:
    """What ``name`` of ``owner_path`` holds: "code" (a function, class or module, or a builtin a module
    may shadow), "data", or "class attribute" (the owner is a class, not a module)."""
    try:
        owner = resolve(owner_path)
    except (ImportError, AttributeError):  # a module that needs what this machine lacks (Triton)
        return static_kind(owner_path, name)
    if not isinstance(owner, types.ModuleType):
        return "class attribute"
    value = getattr(owner, name, getattr(builtins, name, None))
    return "code" if callable(value) or isinstance(value, types.ModuleType) else "data"


def _foreign_writes(folder: str, *, doubles: bool) -> list:
    """Writes in ``folder`` to globals of our modules; ``doubles``: code may be stood in for."""
    found = []
    for path in _files(folder):
        for write in writes(path):
            if write.owner.split(".")[0] not in OURS:
                continue  # torch's, megatron's: not ours to police here
            for name in write.names:
                if name == UNKNOWN:
                    found.append(f"{write.where()} (the attribute's name is not known without running the file)")
                    continue
                kind = _kind(write.owner, name)
                if kind == "class attribute" or (doubles and (kind == "code" or write.code_value)):
                    continue
                found.append(f"{write.where()} ({kind} of {write.owner})")
    return found


def test_te_dist_changes_no_global_of_another_module():
    assert _foreign_writes("te_dist", doubles=False) == []


def test_tests_change_no_module_global_but_may_stand_in_code():
    assert _foreign_writes("tests", doubles=True) == []


def test_the_check_sees_each_form_of_write(tmp_path):
    """The forms the rule covers: each is reported with the owner it writes to."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from te_dist.moe import padding\n"
        "from te_dist import settings as S\n"
        "from cutlass_kernels import heuristics\n"
        "padding._MAX_TRITON_EXPERTS = 1\n"
        "heuristics.FP8_SMALL_M_ROWS += 1\n"
        "setattr(S, 'generation', 3)\n"
        "from te_dist.quantization.formats import FP8_MAX\n"
        "FP8_MAX['x'] = 1\n"
        "heuristics.FP8_CONFIGS[9] = ()\n"
        "def test_x(monkeypatch):\n"
        "    monkeypatch.setattr(padding, 'plan_padding', lambda *a: None)\n"
        "    monkeypatch.setattr('te_dist.gemm.decide.MARGIN', 0.0)\n"
        "    for name in ('a', 'b'):\n"
        "        monkeypatch.setattr(heuristics, name, 1)\n")
    seen = sorted((w.line, w.owner, w.names, w.patched, w.code_value) for w in writes(probe))
    assert seen == [(4, "te_dist.moe.padding", ("_MAX_TRITON_EXPERTS",), False, False),
                    (5, "cutlass_kernels.heuristics", ("FP8_SMALL_M_ROWS",), False, False),
                    (6, "te_dist.settings", ("generation",), False, False),
                    (8, "te_dist.quantization.formats", ("FP8_MAX",), False, False),
                    (9, "cutlass_kernels.heuristics", ("FP8_CONFIGS",), False, False),
                    (11, "te_dist.moe.padding", ("plan_padding",), True, True),
                    (12, "te_dist.gemm.decide", ("MARGIN",), True, False),
                    (14, "cutlass_kernels.heuristics", ("a", "b"), True, False)]
    assert _kind("te_dist.moe.padding", "_MAX_TRITON_EXPERTS") == "data"
    assert _kind("te_dist.moe.padding", "plan_padding") == "code"
    assert _kind("te_dist.ops.GroupedLinear", "native_path") == "class attribute"
    assert static_kind("te_dist.quantization.triton_casts", "cast_fp8_blocks") == "code"
    assert static_kind("te_dist.quantization.triton_casts", "_PT_TILE") == "data"
