"""CPU tests of the public grouped-GEMM calls' remembered facts (``te_dist.gemm.entry``, issue 57).

A call like one that passed the checks (same operand classes, dtypes, devices and shapes but the rows, same options
and settings) runs the remembered function after checking only its rows; a call that differs in any checked fact is
checked in full and fails exactly as a first call would; the remembered path computes what the first one did.
"""

from types import SimpleNamespace

import pytest
import torch

from te_dist import settings
from te_dist.gemm import measure, validation
from te_dist.kernels import grouped_mm_dgrad, grouped_mm_forward, grouped_mm_wgrad

E, K, N = 3, 16, 8  # bf16 rows of whole 16 bytes, as torch._grouped_mm takes them
CHECKS = {"fwd": "check_forward", "dgrad": "check_dgrad", "wgrad": "check_wgrad"}


@pytest.fixture(autouse=True)
def fresh_tuner():
    """Every test starts and ends with an empty memo (a tuner of its own, measuring nothing)."""
    measure.reset(measure.Tuner(measure.TunerSettings(persist=False)))
    yield
    measure.reset()


def _offsets(splits):
    return torch.tensor(splits, dtype=torch.int64).cumsum(0).to(torch.int32)


def _operands(splits=(2, 0, 3), dtype=torch.float32):
    """x [T, K], w [E, K] x [N] as the transposed view of [E, N, K], dy [T, N], offsets."""
    torch.manual_seed(sum(splits))
    T = sum(splits)
    w = torch.randn(E, N, K, dtype=dtype).transpose(1, 2)
    return torch.randn(T, K, dtype=dtype), w, torch.randn(T, N, dtype=dtype), _offsets(splits)


def _call(direction, x, w, dy, off, **kw):
    if direction == "fwd":
        return grouped_mm_forward(x, w, off, **kw)
    if direction == "dgrad":
        return grouped_mm_dgrad(dy, w, off, **kw)
    return grouped_mm_wgrad(x, dy, off, **{"num_groups": E, **kw})


def _counting(monkeypatch, direction) -> list:
    """Counts the full checks of ``direction`` (they still run)."""
    calls, real = [], getattr(validation, CHECKS[direction])
    counted = lambda *a: calls.append(a) or real(*a)  # noqa: E731
    if direction == "fwd":  # each name spelled out: tests/test_module_globals.py reads them without running this file
        monkeypatch.setattr(validation, "check_forward", counted)
    elif direction == "dgrad":
        monkeypatch.setattr(validation, "check_dgrad", counted)
    else:
        monkeypatch.setattr(validation, "check_wgrad", counted)
    return calls


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - compared below
        return type(exc), str(exc)


@pytest.mark.parametrize("backend", ["torch", "loop", None])
@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
def test_a_like_call_runs_the_remembered_function_after_its_row_checks_alone(monkeypatch, direction, backend):
    x, w, dy, off = _operands()
    kw = dict(backend=backend, group_sizes=(2, 0, 3))
    want = _call(direction, x, w, dy, off, **kw)
    checks = _counting(monkeypatch, direction)
    got = _call(direction, x, w, dy, off, **kw)
    x2, _, dy2, off2 = _operands((4, 1, 0))  # other rows, other offsets: a like call
    got2 = _call(direction, x2, w, dy2, off2, backend=backend, group_sizes=(4, 1, 0))
    assert checks == []
    measure.reset(measure.Tuner(measure.TunerSettings(persist=False)))  # the unremembered path computes alike
    assert torch.equal(got, want)
    assert torch.equal(got2, _call(direction, x2, w, dy2, off2, backend=backend, group_sizes=(4, 1, 0)))
    assert len(checks) == 1
    with pytest.raises(ValueError, match=r"offsets_E\[-1\]=4 != num_rows=5"):  # its rows are still checked
        _call(direction, x, w, dy, _offsets((2, 0, 2)), **kw)
    with pytest.raises(ValueError, match="group_sizes sum to 4 but there are 5 rows"):
        _call(direction, x, w, dy, off, backend=backend, group_sizes=(2, 0, 2))
    assert len(checks) == 1


def _like(t):
    """Not a tensor, but reads as one: what a call's facts read of it."""
    return SimpleNamespace(shape=t.shape, dtype=t.dtype, device=t.device, stride=t.stride, is_cpu=t.is_cpu)


def _unlike_calls(direction):
    """{name: zero-argument call} differing from the like call in one checked fact, each raising."""
    x, w, dy, off = _operands()
    T, ops = x.shape[0], {"x": x, "w": w, "dy": dy}
    row, other = {"fwd": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("x", "dy")}[direction]  # the call's operands

    def call(offsets=off, **kw):
        named = {name: kw.pop(name, t) for name, t in ops.items()}
        return lambda: _call(direction, named["x"], named["w"], named["dy"], offsets, **kw)

    calls = {
        "dtype": call(x=x.double(), dy=dy.double()),
        "operand dtypes differ": call(**{other: ops[other].double()}),
        "row operand device": call(**{row: ops[row].to("meta")}),
        "other operand device": call(**{other: ops[other].to("meta")}),
        "row operand not a tensor, read alike": call(**{row: _like(ops[row])}),
        "other operand not a tensor, read alike": call(**{other: _like(ops[other])}),
        "offsets device": call(off.to("meta")),
        "offsets dtype": call(off.long()),
        "offsets not a tensor": call(off.tolist()),
        "offsets not a tensor, read alike": call(_like(off)),
        "E": call(_offsets((2, 0, 3, 0))),
        "out_dtype": call(out_dtype=torch.int32),
        "backend": call(backend="cublas"),
    }
    if direction == "fwd":
        calls["K"] = call(x=torch.randn(T, K + 1))
        calls["bias shape"] = call(bias_EN=torch.randn(E, N + 1))
    if direction == "dgrad":
        calls["N"] = call(dy=torch.randn(T, N + 1))
    if direction != "wgrad":
        calls["row scale rows"] = call(row_scale_T=torch.rand(T + 1))
    else:
        calls["rows of dy"] = call(dy=torch.randn(T + 1, N))
        calls["num_groups"] = call(num_groups=E + 1)
        calls["num_groups type"] = call(num_groups=float(E))
    return calls


@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
def test_a_call_unlike_a_checked_one_fails_as_a_first_call_would(direction):
    first = {name: _outcome(fn) for name, fn in _unlike_calls(direction).items()}  # nothing remembered yet
    assert all(isinstance(o, tuple) and issubclass(o[0], (TypeError, ValueError)) for o in first.values()), first
    x, w, dy, off = _operands()
    T = x.shape[0]
    extras = [{}] if direction == "wgrad" else [{}, {"row_scale_T": torch.rand(T)}]
    if direction == "fwd":
        extras += [{"bias_EN": torch.randn(E, N)}, {"bias_EN": torch.randn(E, N), "row_scale_T": torch.rand(T)}]
    for backend in ("torch", "loop", None):  # a checked call of each kind remembered
        for kw in extras:
            _call(direction, x, w, dy, off, backend=backend, **kw)
    assert {name: _outcome(fn) for name, fn in _unlike_calls(direction).items()} == first


@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
def test_a_valid_call_differing_in_a_checked_fact_is_checked_again(monkeypatch, direction):
    x, w, dy, off = _operands()
    _call(direction, x, w, dy, off, backend="torch")
    checks = _counting(monkeypatch, direction)
    _call(direction, x, w, dy, off, backend="torch")
    assert len(checks) == 0
    x16, w16, dy16 = x.to(torch.bfloat16), w.to(torch.bfloat16), dy.to(torch.bfloat16)
    unlike = [lambda: _call(direction, x16, w16, dy16, off, backend="torch"),  # dtype
              lambda: _call(direction, x, w, dy, off, backend="loop"),  # backend
              lambda: _call(direction, x, w, dy, off, backend="torch", out_dtype=torch.bfloat16),  # out_dtype
              lambda: _call(direction, x, w, dy, off, backend="torch", group_sizes=(2, 0, 3))]  # host sizes given
    for n, fn in enumerate(unlike, start=1):
        fn()
        assert len(checks) == n
    with settings.override(cutlass=not settings.current().cutlass):  # a new settings generation
        _call(direction, x, w, dy, off, backend="torch")
    assert len(checks) == len(unlike) + 1


def test_wgrad_remembers_the_weight_shape_it_was_checked_on():
    """E, K and N of wgrad come from num_groups and both operands: another of any is another call."""
    x, w, dy, off = _operands()
    want = grouped_mm_wgrad(x, dy, off, num_groups=E, backend="torch")
    assert want.shape == (E, K, N)
    got = grouped_mm_wgrad(x[:, :4], dy, off, num_groups=E, backend="torch")
    assert got.shape == (E, 4, N)
    # the same sums, but of a strided operand: the CPU GEMM may block them otherwise (AMD EPYC: 1 ulp apart)
    torch.testing.assert_close(got, want[:, :4], rtol=1e-6, atol=1e-6)


class _DeviceOffsets(torch.Tensor):
    """CPU offsets that read as a device's (``is_cpu`` False): their values are read only when asked, as on CUDA."""

    is_cpu = property(lambda self: False)


@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
def test_a_like_call_on_device_offsets_checks_its_rows_where_there_is_something_to_check(monkeypatch, direction):
    x, w, dy, off = _operands()
    off = off.as_subclass(_DeviceOffsets)
    want = _call(direction, x, w, dy, off, backend="torch")
    _call(direction, x, w, dy, off, backend="torch", group_sizes=(2, 0, 3))
    calls, real = [], validation.check_rows
    monkeypatch.setattr(validation, "check_rows", lambda *a: calls.append(a) or real(*a))
    assert torch.equal(_call(direction, x, w, dy, off, backend="torch"), want)
    assert calls == []  # nothing to check: no call on the like path
    bad = _offsets((2, 0, 2)).as_subclass(_DeviceOffsets)
    with pytest.raises(ValueError, match=r"offsets_E\[-1\]=4 != num_rows=5"):
        _call(direction, x, w, dy, bad, backend="torch", check_offsets=True)
    with pytest.raises(ValueError, match="group_sizes sum to 4 but there are 5 rows"):
        _call(direction, x, w, dy, off, backend="torch", group_sizes=(2, 0, 2))
    assert len(calls) == 2
