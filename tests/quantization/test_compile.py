"""The cast functions trace as one graph (so torch.compile can fuse them) and compiled == eager."""

import pytest
import torch

from te_dist.quantization import cast, compile as qcompile
from te_dist import recipe as R
from te_dist import settings
from te_dist.quantization import make_quantizer, set_compile_enabled


def _cases(device):
    g = torch.Generator(device=device).manual_seed(0)
    noise = torch.rand(64, 128, device=device, generator=g)
    s = torch.tensor(3.0, device=device)
    return [
        (cast.cast_fp8_per_tensor, (s, torch.float8_e4m3fn, 448.0)),
        (cast.current_scaling_quantize, (torch.float8_e4m3fn, 448.0, False)),
        (cast.current_scaling_quantize, (torch.float8_e5m2, 57344.0, True)),
        (cast.delayed_scaling_step, (s, torch.arange(8.0, device=device), torch.float8_e4m3fn, 448.0, 1, "max")),
        (cast.delayed_scaling_step, (s, torch.arange(8.0, device=device), torch.float8_e5m2, 57344.0, 0, "most_recent")),
        (cast.cast_fp8_blocks, (1, 128, torch.float8_e4m3fn, 448.0, True)),
        (cast.cast_fp8_blocks, (64, 128, torch.float8_e5m2, 57344.0, False)),
        (cast.cast_mxfp8, (32, torch.float8_e4m3fn, 448.0, 8, 0)),
        (cast.cast_nvfp4, (16, 16, s, None)),
        (cast.cast_nvfp4, (1, 16, s, noise, True)),
    ]


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return all(torch.equal(_bits(u), _bits(v)) for u, v in zip(a, b))


def test_cast_functions_trace_as_one_graph():
    x = torch.randn(64, 128) * 10
    for fn, args in _cases(torch.device("cpu")):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        assert _same(compiled(x, *args), fn(x, *args)), fn.__name__
    torch._dynamo.reset()


def _one_step_apart(u, v):
    """Each differing byte is one code step away: an FP8 neighbour (byte +-1) or, for packed FP4,
    both nibbles within one step. Neighbouring codes are adjacent grid values of the same sign."""
    a, b = _bits(u).int(), _bits(v).int()
    byte_step = (a - b).abs() <= 1
    nibble_step = ((a & 0xF) - (b & 0xF)).abs().le(1) & ((a >> 4) - (b >> 4)).abs().le(1)
    return bool((byte_step | nibble_step).all())


def _close(a, b):
    """float32 outputs within 1e-6 (a compiled division may differ by an ulp). 1-byte outputs:
    at most 0.5% of codes differ, each by one grid step. E2M1 ties are common (bf16 inputs over
    E4M3 block scales land exactly on grid midpoints), and an ulp of difference in the compiled
    division flips their ties-to-even rounding (seen on H200: 0.12-0.22% of NVFP4 16x16 codes)."""
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    for u, v in zip(a, b):
        if u.element_size() == 1:
            assert (_bits(u) != _bits(v)).float().mean().item() <= 5e-3
            assert _one_step_apart(u, v)
        else:
            torch.testing.assert_close(u, v, rtol=1e-6, atol=0)


@pytest.mark.gpu
def test_inductor_matches_eager_on_cuda(cuda_device):
    x = torch.randn(64, 128, device=cuda_device, dtype=torch.bfloat16) * 10
    for fn, args in _cases(cuda_device):
        compiled = torch.compile(fn, fullgraph=True)
        _close(compiled(x, *args), fn(x, *args))


@pytest.fixture
def stand_in_compile(monkeypatch):
    """Install ``fn -> compiled`` as torch.compile, with no compiled callable or failure remembered
    before or after the test."""
    qcompile.forget_compiled()

    def install(compile_fn):
        monkeypatch.setattr(torch, "compile", compile_fn)

    yield install
    qcompile.forget_compiled()
    torch._dynamo.reset()


def test_compile_failure_falls_back_to_eager(stand_in_compile):
    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("no compiler here")
        return run

    stand_in_compile(broken_compile)
    x = torch.randn(4, 32)
    with settings.override(torch_compile=True), pytest.warns(UserWarning, match="running eagerly"):
        q = make_quantizer(R.MXFP8BlockScaling(), "input")(x)
    with settings.override(torch_compile=False):
        assert torch.equal(q.dequantize(), make_quantizer(R.MXFP8BlockScaling(), "input")(x).dequantize())


def test_set_compile_enabled_validates_and_sets_the_field():
    with pytest.raises(TypeError, match="None, True or False"):
        set_compile_enabled("yes")
    before = settings.current().torch_compile
    try:
        set_compile_enabled(False)
        assert settings.current().torch_compile is False and not qcompile.compile_enabled(torch.device("cuda"))
        set_compile_enabled(None)
        assert qcompile.compile_enabled(torch.device("cpu")) is False
        assert qcompile.compile_enabled(torch.device("cuda")) is True
    finally:
        set_compile_enabled(before)


def test_each_configuration_has_its_own_compile_cache(stand_in_compile):
    """More configurations than Dynamo's per-code recompile limit (8) must all stay compiled."""
    real_compile = torch.compile
    calls = []

    def cheap_compile(fn, **kwargs):
        calls.append(fn)
        return real_compile(fn, backend="eager", fullgraph=kwargs.get("fullgraph", False))

    stand_in_compile(cheap_compile)
    x = torch.randn(4, 128)
    import warnings

    with warnings.catch_warnings(), settings.override(torch_compile=True):
        warnings.simplefilter("error")  # a fallback to eager would warn
        for margin in range(12):
            quantizer = make_quantizer(R.MXFP8BlockScaling(margin=margin), "input")
            q = quantizer(x)
            assert q.rowwise.scale_inv.dtype == torch.float8_e8m0fnu
    assert len(calls) == 12 and len({id(fn.__code__) for fn in calls}) == 12
    assert not qcompile._failed


@pytest.mark.parametrize("name", ["delayed", "current", "block", "mxfp8", "nvfp4"])
def test_quantizers_through_dispatch_match_eager(stand_in_compile, name):
    real_compile = torch.compile
    stand_in_compile(lambda fn, **kw: real_compile(fn, backend="aot_eager", fullgraph=True))
    recipe = R.recipe_from_name(name)
    x = torch.randn(128, 128, dtype=torch.bfloat16)
    results = []
    for enabled in (True, False):
        torch.manual_seed(0)
        outs = []
        with settings.override(torch_compile=enabled):
            for role in ("input", "weight", "grad_output"):
                quantizer = make_quantizer(recipe, role)
                outs += [quantizer(x, columnwise=True).dequantize(), quantizer(x).dequantize()]
        results.append(outs)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not qcompile._failed
