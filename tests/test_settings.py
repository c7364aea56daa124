"""te_dist.settings, the switchboard: the environment read once, one override, clear errors, caches that
follow a change, and the README switch table and docs/settings.md checked against the fields both ways."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from te_dist import recipe as R
from te_dist import settings, support

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in settings.fields()]


# ---------------------------------------------------------------------- the environment


def test_every_field_names_its_variable_and_says_what_it_switches():
    envs = [f.metadata["env"] for f in settings.fields()]
    assert len(set(envs)) == len(envs) and all(e.startswith("TE_DIST_") for e in envs)
    assert all(len(f.metadata["doc"]) > 60 for f in settings.fields())
    assert settings.from_environ({}) == (settings.Settings(), dict.fromkeys(FIELDS, "default"))


def test_the_environment_parses_each_kind_of_field():
    values, sources = settings.from_environ({
        "TE_DIST_DISABLE_CUTLASS": "1", "TE_DIST_TUNE": "off", "TE_DIST_EP_TRANSPORT": "nccl",
        "TE_DIST_FUSED_CASTS": "auto", "TE_DIST_TORCH_COMPILE": " False ", "TE_DIST_TRITON_PADDING": "yes",
        "TE_DIST_GATHER_IN_EXPERTS": "0", "TE_DIST_FP8_PAD_OFF_GRID": "on", "TE_DIST_FP8_TILE": "3",
        "TE_DIST_UNRELATED": "x"})
    assert values == settings.Settings(cutlass=False, tune=False, ep_transport="all_to_all", fused_casts=None,
                                       torch_compile=False, triton_padding=True, gather_in_experts=False,
                                       fp8_pad_off_grid=True, fp8_tile=3)
    assert sources["cutlass"] == "TE_DIST_DISABLE_CUTLASS=1" and sources["ep_transport"] == "TE_DIST_EP_TRANSPORT=nccl"
    assert settings.from_environ({"TE_DIST_DISABLE_CUTLASS": "0", "TE_DIST_TUNE": ""})[0] == settings.Settings()


@pytest.mark.parametrize("env,value,accepted", [
    ("TE_DIST_TUNE", "maybe", "expected 0 or 1 (also true/false, yes/no, on/off)"),
    ("TE_DIST_DISABLE_CUTLASS", "please", "expected 0 or 1"),
    ("TE_DIST_FUSED_CASTS", "2", "expected auto, 0 or 1"),
    ("TE_DIST_EP_TRANSPORT", "fast", "expected one of auto, all_to_all, peer (or nccl, read as all_to_all)"),
    ("TE_DIST_FP8_TILE", "-1", "expected a tile id: a non-negative integer"),
])
def test_a_bad_variable_names_itself_its_value_and_what_it_accepts(env, value, accepted):
    field = next(f.name for f in settings.fields() if f.metadata["env"] == env)
    with pytest.raises(ValueError) as info:
        settings.from_environ({env: value})
    assert str(info.value).startswith(f"{env}={value!r} (te_dist.settings.{field}) is not accepted: {accepted}")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    import os

    full = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    for f in settings.fields():  # only the variables this test sets
        if f.metadata["env"] not in env:
            full.pop(f.metadata["env"], None)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_read_once_on_first_use_never_at_import():
    """In a fresh process: a bad variable does not break ``import te_dist`` (nothing is read there), it
    raises at the first use; a good one is read once, so a later change of os.environ is not seen."""
    bad = _python("import te_dist, te_dist.settings, te_dist.support, te_dist.moe, te_dist.quantization\n"
                  "print('imported', te_dist.__file__)\n"
                  "try:\n    te_dist.settings.tune\nexcept ValueError as e:\n    print('raised', e)\n",
                  TE_DIST_TUNE="maybe")
    assert bad.returncode == 0, bad.stderr
    assert f"imported {ROOT / 'te_dist' / '__init__.py'}" in bad.stdout
    assert "raised TE_DIST_TUNE='maybe' (te_dist.settings.tune) is not accepted" in bad.stdout
    good = _python("import json, os, te_dist\n"
                   "first = te_dist.settings.current()\n"
                   "os.environ['TE_DIST_EP_TRANSPORT'] = 'peer'; os.environ['TE_DIST_TUNE'] = '1'\n"
                   "print(json.dumps([first.ep_transport, te_dist.settings.ep_transport, te_dist.settings.tune,"
                   " te_dist.settings.source('tune')]))",
                   TE_DIST_EP_TRANSPORT="all_to_all", TE_DIST_TUNE="0")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout) == ["all_to_all", "all_to_all", False, "TE_DIST_TUNE=0"]


# ---------------------------------------------------------------------- changing them in code


def test_override_nests_restores_on_exit_and_on_an_exception():
    start = settings.current()
    with settings.override(tune=not start.tune, fp8_tile=2) as inside:
        assert inside is settings.current() and (inside.tune, inside.fp8_tile) == (not start.tune, 2)
        with settings.override(fp8_tile=4):
            assert settings.current().fp8_tile == 4 and settings.current().tune == (not start.tune)
            assert settings.source("fp8_tile") == "te_dist.settings.fp8_tile=4"
        assert settings.current().fp8_tile == 2
        with pytest.raises(RuntimeError, match="inside"):
            with settings.override(fused_casts=False):
                raise RuntimeError("inside")
        assert settings.current().fused_casts == start.fused_casts
    assert settings.current() == start


def test_bad_values_change_nothing_and_name_the_field():
    start, generation = settings.current(), settings.generation
    with pytest.raises(ValueError, match=r"te_dist.settings.tune must be True or False, received 'no'"):
        with settings.override(fp8_tile=1, tune="no"):
            pass
    with pytest.raises(TypeError, match=r"te_dist.settings has no field 'fused_cast'; its fields: cutlass, tune"):
        with settings.override(fused_cast=False):
            pass
    with pytest.raises(ValueError, match=r"fp8_tile must be None \(the rule\) or a non-negative int tile id, "
                                         r"received True"):
        settings.set_for_process(fp8_tile=True)
    with pytest.raises(ValueError, match=r"fused_casts must be None \(automatic\), True or False, received 1"):
        with settings.override(fused_casts=1):
            pass
    assert settings.current() == start and settings.generation == generation


def test_an_override_wins_over_the_process_value_while_it_lasts():
    before = settings.current().triton_padding
    try:
        with settings.override(triton_padding=True):
            settings.set_for_process(triton_padding=False)
            assert settings.current().triton_padding is True
        assert settings.current().triton_padding is False
        assert settings.source("triton_padding") == "te_dist.settings.triton_padding=False"
    finally:
        settings.set_for_process(triton_padding=before)


def test_values_are_process_wide_and_overrides_of_two_threads_undo_in_any_order():
    """Another thread (as autograd's backward threads) sees an override; two overlapping overrides from
    two threads, exited in the order they were entered, each remove only their own field."""
    start = settings.current()
    seen, entered, release_a = [], threading.Event(), threading.Event()

    def thread_a():
        with settings.override(fp8_tile=1):
            entered.set()
            release_a.wait(30)

    a = threading.Thread(target=thread_a)
    a.start()
    assert entered.wait(30)
    with settings.override(gather_in_experts=not start.gather_in_experts):
        reader = threading.Thread(target=lambda: seen.append(settings.current()))
        reader.start()
        reader.join(30)
        release_a.set()
        a.join(30)
        assert settings.current().fp8_tile == start.fp8_tile  # A's layer went; ours stays
        assert settings.current().gather_in_experts == (not start.gather_in_experts)
    assert seen[0].fp8_tile == 1 and seen[0].gather_in_experts == (not start.gather_in_experts)
    assert settings.current() == start


def test_generation_moves_only_when_the_values_change():
    generation = settings.generation
    with settings.override(tune=settings.current().tune):  # the same value: nothing changed
        assert settings.generation == generation
    with settings.override(fp8_tile=3):
        assert settings.generation > generation


def test_module_attributes_read_the_values_in_force():
    with settings.override(ep_transport="peer", torch_compile=False):
        assert settings.ep_transport == "peer" and settings.torch_compile is False
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        settings.nope


# ---------------------------------------------------------------------- caches follow the settings

HOPPER = (9, 0)


def test_the_support_predicates_follow_the_cutlass_field():
    """A cached answer that read the kernels' availability is dropped when the setting changes: no
    clear_caches() call is needed (and none re-reads the environment)."""
    cuda0 = torch.device("cuda", 0)
    block = R.Float8BlockScaling()
    ask = lambda: support.is_op_fuser_grouped_tensor_supported(block, torch.bfloat16, split_alignment=128,  # noqa: E731
                                                               device=cuda0)
    with support.set_capability_lookup(lambda d: HOPPER if d.type == "cuda" else None), \
            support.set_fp8_kernels_lookup(lambda: not support.cutlass_disabled()), settings.override(cutlass=True):
        assert ask() and ask()
        with settings.override(cutlass=False):
            assert not ask()
            assert support.explain_path(block, torch.bfloat16, device=cuda0) == ("emulated", (
                "FP8 grouped kernels unavailable: our kernels are turned off (te_dist.settings.cutlass=False)"))
        assert ask()
        hits = support.is_op_fuser_grouped_tensor_supported.cache_info().hits
        assert ask() and support.is_op_fuser_grouped_tensor_supported.cache_info().hits == hits + 1


def test_the_default_kernel_lookup_reads_the_field():
    with settings.override(cutlass=False):
        assert support.cutlass_disabled() and not support.fp8_kernels_available()
        assert support.fp8_kernels_unavailable_reason() == "our kernels are turned off (te_dist.settings.cutlass=False)"
        from te_dist.gemm import cutlass_backend

        assert not cutlass_backend.is_available(torch.device("cpu"))


# ---------------------------------------------------------------------- the documents


def _readme_switch_rows() -> list:
    """{column: cell} of every row of README's "Turning a fast path off" table."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("## Turning a fast path off")
    header = next(i for i in range(start, len(lines)) if lines[i].startswith("| fast path |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def test_the_readme_switch_table_and_the_fields_agree_both_ways():
    """Every row names one field and its variable, except the fusion rules (the recipe/fusion contract
    of docs/fusion.md, switched in code only); every field has a row."""
    rows, named = _readme_switch_rows(), set()
    envs = {f.name: f.metadata["env"] for f in settings.fields()}
    for row in rows:
        path, cell, env = row["fast path"], row["te_dist.settings"], row["environment"]
        if cell == "—":
            assert env == "—" and "fusion_rules_scope" in row["also"], row
            assert "enable_fused_grouped_mlp" in row["also"], row
            continue
        field = re.fullmatch(r"`(\w+)`", cell)
        assert field is not None and field.group(1) in envs, f"README row {path!r} names no field: {cell}"
        assert re.fullmatch(rf"`{envs[field.group(1)]}=[^`]+`", env), f"README row {path!r}: {env}"
        named.add(field.group(1))
    assert set(envs) - named == set(), "fields the README switch table leaves out"
    assert sum(row["te_dist.settings"] == "—" for row in rows) == 1


def test_docs_settings_lists_every_field_with_its_variable_and_default():
    text = (ROOT / "docs" / "settings.md").read_text()
    listed = re.findall(r"^\| `(\w+)` \| `(TE_DIST_\w+)` \| `([^`]*)` \|", text, flags=re.M)
    assert [name for name, _, _ in listed] == FIELDS
    for f, (_, env, default) in zip(settings.fields(), listed):
        assert env == f.metadata["env"] and default == repr(f.default), f.name
    assert "docs/settings.md" in (ROOT / "README.md").read_text()
