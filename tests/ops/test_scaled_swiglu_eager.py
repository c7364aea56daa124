"""The uncompiled (CPU) scaled-SwiGLU backward: fewer eager ops than the function torch.compile
fuses on CUDA, the same values (float64 autograd reference, and the compiled function run eagerly)."""

import pytest
import torch

from te_dist.ops.basic import swiglu


def _reference(da, h, probs, limit):
    h64 = h.double().requires_grad_()
    p64 = probs.double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    s = torch.nn.functional.silu(gate) * up
    scaled = s * p64[:, None]
    scaled.backward(da.double())
    return h64.grad, p64.grad, scaled.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_eager_matches_reference_and_kernel(dtype, limit):
    torch.manual_seed(0)
    T, F = 6, 8
    h = torch.randn(T, 2 * F).to(dtype)
    da = torch.randn(T, F).to(dtype)
    probs = torch.rand(T)
    dh, dprobs, scaled = swiglu._scaled_swiglu_backward_eager(da, h, probs, limit)
    assert dh.dtype == dtype and scaled.dtype == dtype and dprobs.dtype == torch.float32
    assert dh.shape == h.shape and dprobs.shape == (T,) and scaled.shape == (T, F)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip((dh, dprobs, scaled), _reference(da, h, probs, limit)):
        torch.testing.assert_close(got.double(), want, **tol)
    for got, want in zip((dh, dprobs, scaled), swiglu._scaled_swiglu_backward_kernel(da, h, probs, limit)):
        torch.testing.assert_close(got, want, **tol)
    if limit is not None:
        clamped = (h[:, :F].float() > limit) | (h[:, F:].float().abs() > limit)
        assert clamped.any(), "the test data must exercise the clamp"


def test_cpu_call_takes_the_eager_path(monkeypatch):
    calls = []
    monkeypatch.setattr(swiglu, "_scaled_swiglu_backward_eager", lambda *a: calls.append(a) or (None, None, None))
    swiglu.scaled_swiglu_backward(torch.randn(2, 4), torch.randn(2, 8), torch.rand(2), None)
    assert len(calls) == 1


def test_fp8_kept_input_off_cuda_is_dequantized_first():
    """The FP8 copy of the SwiGLU input (kept by the grouped MLP under FP8 recipes on CUDA) is read
    through its dequantized values where the Triton kernel cannot run; the forward that would write
    it answers None there, so the caller keeps h itself."""
    from te_dist.quantization import cast

    torch.manual_seed(0)
    T, F = 5, 128
    h = (4 * torch.randn(T, 2 * F)).to(torch.bfloat16)
    data, scale_inv = cast.cast_fp8_blocks(h, 1, 128, torch.float8_e4m3fn, 448.0, True)
    kept = swiglu.Fp8Input(data, scale_inv.reshape(T, 2), torch.bfloat16)
    dequantized = kept.dequantize()
    assert dequantized.dtype == torch.bfloat16 and dequantized.shape == h.shape
    assert torch.equal(dequantized, (data.float() * scale_inv.reshape(T, 2).repeat_interleave(128, 1)).bfloat16())
    assert 0 < (dequantized.float() - h.float()).abs().max() <= h.float().abs().max() / 8  # E4M3 rounding
    da, probs = torch.randn(T, F).to(torch.bfloat16), torch.rand(T)
    got = swiglu.scaled_swiglu_backward(da, kept, probs, None)
    want = swiglu.scaled_swiglu_backward(da, dequantized, probs, None)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert swiglu.scaled_swiglu_forward_keeping_fp8(h, probs, None) is None
