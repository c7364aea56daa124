"""Amax hints (te_dist.quantization.amax_hints): a producer kernel tells max |y|, the current-scaling cast of y
takes it instead of its amax pass, and gets the same bytes.

CPU: when a hint is found and when it must not be (another tensor, an in-place write, a dead tensor, a view over
other elements); the quantizer's cast with a hint equals the cast without, and a hint is really what it uses.
Triton's interpreter (``TRITON_INTERPRET=1`` with triton installed, else skipped: CI has no Triton): the
cross-entropy backward tells the amax of what it stores, under current scaling only. GPU (``-m gpu``): the SwiGLU
forward and backward tell theirs; the grouped MLP's step under current scaling, the same bits with the hints as
without."""

from __future__ import annotations

import gc

import pytest
import torch

from te_dist import recipe as R
from te_dist.quantization import amax_hints, make_quantizer
from triton_interpreter import HAS_TRITON, needs_interpreter



def _bits_of(y: torch.Tensor) -> int:
    """The amax pass's answer: max of |y| as float32 bits (what the producers must tell)."""
    return y.float().abs().view(torch.int32).max().item()


def _offered(y: torch.Tensor) -> torch.Tensor:
    bits = torch.tensor([_bits_of(y)], dtype=torch.int32)
    amax_hints.offer(y, bits)
    return bits


def test_a_hint_is_found_only_for_the_same_unchanged_elements():
    y = torch.randn(64, 32, dtype=torch.bfloat16)
    _offered(y)
    want = y.float().abs().max()
    for same in (y, y.detach(), y.view(32, 64), y.reshape(-1)):
        assert amax_hints.take(same) == want
    assert amax_hints.take(y.clone()) is None  # other memory
    assert amax_hints.take(y[1:]) is None  # other elements
    assert amax_hints.take(y.t()) is None  # not contiguous
    assert amax_hints.take(y.view(torch.int16)) is None  # another dtype
    y.mul_(2)  # an in-place write bumps the version counter
    assert amax_hints.take(y) is None and amax_hints.take(y.detach()) is None


def test_a_hint_goes_with_its_tensor():
    y = torch.randn(128, dtype=torch.bfloat16)
    _offered(y)
    key = (y.data_ptr(), y.numel(), y.dtype)
    assert key in amax_hints._hints
    del y
    gc.collect()
    assert key not in amax_hints._hints


@pytest.mark.parametrize("columnwise", [False, True])
def test_the_current_scaling_cast_with_a_hint_equals_the_cast_without(columnwise):
    """Bit for bit with the true amax; and the hint is what the cast uses (a doubled one halves the scale)."""
    q = make_quantizer(R.Float8CurrentScaling(), "input")
    y = torch.randn(256, 128, dtype=torch.bfloat16) * 3
    plain = q(y.clone(), rowwise=True, columnwise=columnwise)
    bits = _offered(y)
    hinted = q(y, rowwise=True, columnwise=columnwise)
    assert torch.equal(hinted.scale_inv, plain.scale_inv)
    assert torch.equal(hinted.data.view(torch.uint8), plain.data.view(torch.uint8))
    bits.copy_((bits.view(torch.float32) * 2).view(torch.int32))  # a hint that lies: the cast follows it
    assert torch.equal(q(y, rowwise=True).scale_inv, plain.scale_inv * 2)


def test_only_current_scaling_takes_hints():
    assert make_quantizer(R.Float8CurrentScaling(), "grad_output").takes_amax_hint
    for recipe in (R.DelayedScaling(), R.Float8BlockScaling(), R.MXFP8BlockScaling()):
        assert not make_quantizer(recipe, "input").takes_amax_hint, recipe


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("limit", [None, 0.5])
def test_the_swiglu_kernels_tell_the_amax_of_what_they_store(cuda_device, limit):
    """(On the GPU only: their loops run over a runtime F, which Triton's interpreter cannot iterate.)"""
    from te_dist.ops.basic import swiglu_triton as st

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(600, 512, generator=g) * 2).to(cuda_device, torch.bfloat16)
    probs = torch.rand(600, generator=g).to(cuda_device)
    scaled, h_fp8, h_scale_inv = st.scaled_swiglu_forward_fp8(h, probs, limit, tell_amax=True)
    assert amax_hints.take(scaled).view(torch.int32).item() == _bits_of(scaled)
    da = torch.randn(600, 256, generator=g).to(cuda_device, torch.bfloat16)
    for kept in ((h, None), (h_fp8, h_scale_inv)):
        dh, _, _ = st.scaled_swiglu_backward(da, kept[0], probs, limit, want_scaled=False, h_scale_inv=kept[1],
                                             out_dtype=torch.bfloat16, tell_amax=True)
        assert amax_hints.take(dh).view(torch.int32).item() == _bits_of(dh)
    untold, _, _ = st.scaled_swiglu_backward(da, h, probs, limit, want_scaled=False)
    assert amax_hints.take(untold) is None


@needs_interpreter
def test_the_cross_entropy_backward_tells_the_amax_under_current_scaling():
    from te_dist.autocast import autocast
    from te_dist.train import cross_entropy as ce

    g = torch.Generator().manual_seed(1)
    for recipe, told in ((R.Float8CurrentScaling(), True), (R.Float8BlockScaling(), False), (None, False)):
        x = (torch.randn(5, 5000, generator=g) * 4).to(torch.bfloat16).requires_grad_(True)
        y = torch.randint(0, 5000, (5,), generator=g)
        with autocast(recipe=recipe):
            loss = ce._FusedCrossEntropy.apply(x, y)
        grads = []
        x.register_hook(lambda grad: grads.append(grad))
        loss.backward()
        hint = amax_hints.take(grads[0])
        assert (hint is not None) == told, recipe
        if told:
            assert hint.view(torch.int32).item() == _bits_of(grads[0])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_the_grouped_mlp_step_is_the_same_with_and_without_hints(cuda_device, monkeypatch):
    """The MoE layer's step under current scaling (native path): output and gradients bit for bit with the
    hints and with every hint ignored; the hints were taken."""
    import te_dist as td

    torch.manual_seed(0)
    layer = td.moe.MoELayer(512, 384, 8, 2, dtype=torch.bfloat16, device=cuda_device)
    x = torch.randn(1024, 512, device=cuda_device, dtype=torch.bfloat16, requires_grad=True)
    taken = []
    real_take = amax_hints.take

    def step(take):
        monkeypatch.setattr(amax_hints, "take", take)
        x.grad = layer.fc1.weight.grad = layer.fc2.weight.grad = None
        with td.autocast(recipe=R.Float8CurrentScaling()):
            y = layer(x)
        y.float().square().mean().backward()
        return [t.detach().clone() for t in (y, x.grad, layer.fc1.weight.grad, layer.fc2.weight.grad)]

    step(real_take)  # kernels compiled, weight copies cast
    with_hints = step(lambda t: taken.append(real_take(t)) or taken[-1])
    without = step(lambda t: None)
    assert layer.fc1.has_native_weight_copy and sum(h is not None for h in taken) >= 2, taken
    for a, b, name in zip(with_hints, without, ("y", "dx", "dw1", "dw2")):
        assert torch.equal(a, b), name
