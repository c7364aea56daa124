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
