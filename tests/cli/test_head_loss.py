"""te-dist train's LM head and loss in one step (te_dist/train/head_loss.py): the logits' gradient written as the
head's FP8 operand by the loss's backward.

Interpreter (triton and ``TRITON_INTERPRET=1``, else skipped: CI has no Triton): the forward's max |softmax - onehot|
and the FP8 backward's bytes, transposed copy and scale equal the current-scaling cast of the bf16 gradient the
fused backward writes, bit for bit, over ragged shapes, a target that is the row's maximum, both FP8 formats,
power-of-two scales and a negative or zero upstream gradient; the forward's per-lane non-target max
(``head_loss_lane_max``) against its per-element mask, row by row (also on the GPU). CPU: when the one-step path is taken (the switch, the
head type, the recipe, the device; never Float8BlockScaling's 1x128 gradient) and that the fallback is the plain
loss. GPU (``-m gpu``): the one step against the head's own forward and the fused loss, the same loss and the same
gradients, bit for bit."""

from __future__ import annotations

import pytest
import torch

from te_dist import recipe as R
from te_dist import settings
from te_dist.autocast import autocast, get_active_recipe, get_recipe_key
from te_dist.ops import BasicLinear
from te_dist.train import cross_entropy as ce
from te_dist.train import head_loss
from triton_interpreter import HAS_TRITON, needs_interpreter

E4M3 = (torch.float8_e4m3fn, 448.0)
E5M2 = (torch.float8_e5m2, 57344.0)


def _case(T, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * 3).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    logits[1, targets[1]] = 30.0  # the target is the row's maximum: 1 - p_t is that row's largest term
    return logits, targets


def _bf16_gradient(logits, targets, grad_loss):
    """What the fused cross-entropy's backward stores for ``grad_loss`` (the two-step path's gradient)."""
    x = logits.detach().clone().requires_grad_(True)
    ce._FusedCrossEntropy.apply(x, targets).backward(grad_loss.reshape(()))
    return x.grad


def _check_lane_max(V, device):
    """head_loss_lane_max: the forward's max |softmax - onehot| from the per-lane maxima and the target lane's
    other chunks, bit for bit the per-element mask's, loss and lse unchanged, row by row (the merged max would
    hide a row's error behind another row's). Rows cover the target in each chunk and lane, the target as the
    row's maximum, and the largest non-target logit in the target's own lane (another chunk), where the lane's
    running max is the target's."""
    block = ce._BLOCK
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(8, V, generator=g) * 3
    targets = torch.tensor([0, V - 1, block - 1, min(block, V - 1), V // 2, 3, V - 1 - block // 2, 7])
    logits[1, V - 1] = 30.0  # the target is the row's maximum
    t = int(targets[4])
    logits[4, t] = 30.0
    logits[4, t % block + (block if t < block and V > block else 0)] = 25.0  # the non-target max in the target's lane
    logits, targets = logits.to(device, torch.bfloat16), targets.to(device)
    p = torch.softmax(logits.float(), -1) - torch.nn.functional.one_hot(targets, V)
    for row in range(len(targets)):
        runs = {}
        for lane in (False, True):
            dmax = torch.zeros(1, dtype=torch.int32, device=device)
            with settings.override(head_loss_lane_max=lane):
                runs[lane] = (*ce.forward_rows(logits[row:row + 1], targets[row:row + 1], dmax), dmax)
        for got, want in zip(runs[True], runs[False]):
            assert torch.equal(got, want), (row, got, want)
        torch.testing.assert_close(runs[True][2].view(torch.float32).reshape(()), p[row].abs().max(),
                                   rtol=1e-3, atol=1e-6)  # torch's softmax rounds otherwise: a sanity check


@needs_interpreter
@pytest.mark.parametrize("V", [4096, 9000, 8292])
def test_the_lane_max_equals_the_masked_max_of_the_forward(V):
    _check_lane_max(V, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("V", [4096, 9000, 32000])
def test_the_lane_max_equals_the_masked_max_of_the_forward_on_cuda(cuda_device, V):
    _check_lane_max(V, cuda_device)


@needs_interpreter
@pytest.mark.parametrize("T,V,dtype", [(24, 384, torch.bfloat16), (20, 200, torch.bfloat16), (8, 4500, torch.float16)])
@pytest.mark.parametrize("fmt,power_2", [(E4M3, True), (E5M2, False), (E4M3, False)])
@pytest.mark.parametrize("grad_loss", [1.7, -0.5, 0.0])
def test_fp8_gradient_equals_the_cast_of_the_bf16_gradient(T, V, dtype, fmt, power_2, grad_loss, monkeypatch):
    from triton_interpreter import patch_interpreter_conversions

    from te_dist.quantization.cast import current_scaling_quantize
    from te_dist.train.head_loss_triton import cross_entropy_grad_fp8

    patch_interpreter_conversions(monkeypatch)
    logits, targets = _case(T, V, dtype)
    dmax = torch.zeros(1, dtype=torch.int32)
    loss_T, lse_T = ce.forward_rows(logits, targets, dmax)
    plain_loss, plain_lse = ce.forward_rows(logits, targets)
    assert torch.equal(loss_T, plain_loss) and torch.equal(lse_T, plain_lse)  # the amax costs the loss nothing
    g = torch.tensor(grad_loss)
    grad = _bf16_gradient(logits, targets, g)
    # the forward's max |softmax - onehot|, scaled and rounded as stored, is the stored gradient's amax
    want_amax = grad.float().abs().max()
    got_amax = (dmax.view(torch.float32) * abs(grad_loss) / T).to(dtype).float()
    assert torch.equal(got_amax.reshape(()), want_amax)
    fp8_dtype, fmt_max = fmt
    data, data_t, scale_inv = cross_entropy_grad_fp8(logits, targets, lse_T, g, dmax, fp8_dtype, fmt_max, power_2)
    ref, ref_scale_inv = current_scaling_quantize(grad, fp8_dtype, fmt_max, power_2)
    assert torch.equal(scale_inv, ref_scale_inv.reshape(()).float())
    assert torch.equal(data.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(data_t.view(torch.uint8), ref.view(torch.uint8).t().contiguous())


@needs_interpreter
def test_rows_off_the_word_multiple_are_refused_before_any_kernel():
    from te_dist.train.head_loss_triton import cross_entropy_grad_fp8

    logits, targets = _case(6, 128, torch.bfloat16)
    with pytest.raises(ValueError, match=r"multiples of 4.*\(6, 128\)"):
        cross_entropy_grad_fp8(logits, targets, torch.zeros(6), torch.ones(()), torch.zeros(1, dtype=torch.int32),
                               *E4M3, False)


@needs_interpreter
@pytest.mark.parametrize("recipe", [R.Float8CurrentScaling(), R.Float8CurrentScaling(use_power_2_scales=True)],
                         ids=["current", "current_pow2"])
def test_one_step_equals_head_then_loss_in_the_interpreter(recipe, monkeypatch):
    """The autograd wiring on CPU: the head's native branch forced (its GEMMs emulated on the same quantized
    operands, tests/ops/test_dense_fp8.py), the Triton kernels and casts in the interpreter. Loss, dx and dW of the
    one step equal the head's forward, the fused loss and the head's backward casting the bf16 gradient."""
    from triton_interpreter import patch_interpreter_conversions

    from te_dist.ops.basic.dense_fp8 import DenseFP8

    patch_interpreter_conversions(monkeypatch)
    monkeypatch.setattr(DenseFP8, "applies", staticmethod(lambda op, x2: True))
    torch.manual_seed(0)
    T, H, V = 128, 128, 256
    head = BasicLinear(H, V, dtype=torch.bfloat16)
    h0 = torch.randn(T, H, dtype=torch.bfloat16)
    y = torch.randint(0, V, (T,))
    results = []
    for one_step in (False, True):
        h = h0.clone().requires_grad_(True)
        head.weight.grad = None
        with settings.override(fused_casts=True), autocast(recipe=recipe):
            if one_step:
                head.ensure_recipe_state(get_active_recipe(), get_recipe_key())
                loss = head_loss._HeadLossFP8.apply(h, head.weight, y, head)
            else:
                loss = ce._FusedCrossEntropy.apply(head(h), y)
            (loss * 3).backward()
        results.append((loss.detach(), h.grad, head.weight.grad.clone()))
    (l0, dx0, dw0), (l1, dx1, dw1) = results
    assert torch.equal(l0, l1) and torch.equal(dx0, dx1) and torch.equal(dw0, dw1)


def test_the_one_step_path_is_taken_only_where_it_applies():
    head = BasicLinear(128, 256, dtype=torch.bfloat16)
    h = torch.randn(16, 128, dtype=torch.bfloat16)
    with settings.override(fp8_head_loss=True), autocast(recipe=R.Float8CurrentScaling()):
        assert not head_loss.fp8_gradient_applies(head, h)  # CPU rows: no native FP8 GEMM
        assert not head_loss.fp8_gradient_applies(torch.nn.Linear(128, 256), h)
    with settings.override(fp8_head_loss=False), autocast(recipe=R.Float8CurrentScaling()):
        assert not head_loss.fp8_gradient_applies(head, h)
    with settings.override(fp8_head_loss=True):
        assert not head_loss.fp8_gradient_applies(head, h)  # no recipe
    with settings.override(fp8_head_loss=True), autocast(recipe=R.Float8BlockScaling()):
        assert not head_loss.fp8_gradient_applies(head, h)  # CPU rows


@pytest.mark.parametrize("recipe,want", [(R.Float8CurrentScaling(), True), (R.Float8BlockScaling(), False)],
                         ids=["current", "block"])
def test_the_one_step_is_taken_under_current_scaling_only(recipe, want, monkeypatch):
    """With the head's own checks faked true (a CUDA tensor's stand-in): current scaling's gradient takes the one
    step, Float8BlockScaling's 1x128 gradient the two (the loss, then the head's backward casting it)."""
    from te_dist.ops.basic.dense_fp8 import DenseFP8

    monkeypatch.setattr(DenseFP8, "applies", staticmethod(lambda op, x2: True))
    monkeypatch.setattr(head_loss, "fused_available", lambda logits: True)
    head = BasicLinear(128, 256, dtype=torch.bfloat16)
    cuda_rows = type("Rows", (), {"is_cuda": True, "shape": (256, 128), "dim": lambda self: 2})()
    with settings.override(fp8_head_loss=True), autocast(recipe=recipe):
        assert head_loss.fp8_gradient_applies(head, cuda_rows) == want


def test_the_fallback_is_the_plain_loss():
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 64, bias=False)
    h = torch.randn(8, 32, requires_grad=True)
    y = torch.randint(0, 64, (8,))
    got = head_loss.lm_head_loss(head, h, y, fused=True)
    want = torch.nn.functional.cross_entropy(head(h).float(), y)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("T,V", [(512, 1024), (324, 384), (1024, 32000)])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_gradient_kernel_equals_the_cast_on_cuda(cuda_device, T, V, fmt):
    """The kernel's rows, transposed copy and scale against the fused casts of the bf16 gradient on the GPU (an
    earlier variant wrote right rows and wrong transposed words there, and right ones in the interpreter)."""
    from te_dist.quantization.fused import transpose_fp8
    from te_dist.quantization.triton_casts import cast_from_amax
    from te_dist.train.head_loss_triton import cross_entropy_grad_fp8

    logits, targets = (t.to(cuda_device) for t in _case(T, V, torch.bfloat16))
    dmax = torch.zeros(1, dtype=torch.int32, device=cuda_device)
    _, lse_T = ce.forward_rows(logits, targets, dmax)
    g = torch.tensor(3.0, device=cuda_device)
    grad = _bf16_gradient(logits, targets, g)
    data, data_t, scale_inv = cross_entropy_grad_fp8(logits, targets, lse_T, g, dmax, *fmt, False)
    ref, ref_scale_inv = cast_from_amax(grad, grad.float().abs().max(), *fmt, False)
    assert torch.equal(scale_inv, ref_scale_inv.reshape(()))
    assert torch.equal(data.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(data_t.view(torch.uint8), transpose_fp8(ref).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("recipe", [R.Float8CurrentScaling(), R.Float8CurrentScaling(use_power_2_scales=True)],
                         ids=["current", "current_pow2"])
def test_one_step_equals_head_then_loss_on_cuda(cuda_device, recipe):
    torch.manual_seed(0)
    T, H, V = 512, 256, 1024
    head = BasicLinear(H, V, dtype=torch.bfloat16, device=cuda_device)
    h0 = torch.randn(T, H, dtype=torch.bfloat16, device=cuda_device)
    y = torch.randint(0, V, (T,), device=cuda_device)
    results = []
    for on in (False, True):
        h = h0.clone().requires_grad_(True)
        head.weight.grad = None
        with settings.override(fp8_head_loss=on), autocast(recipe=recipe):
            assert head_loss.fp8_gradient_applies(head, h) == on
            loss = head_loss.lm_head_loss(head, h, y, fused=True)
        (loss * 3).backward()
        results.append((loss.detach(), h.grad, head.weight.grad.clone()))
    (l0, dx0, dw0), (l1, dx1, dw1) = results
    assert torch.equal(l0, l1)
    assert torch.equal(dx0, dx1)
    assert torch.equal(dw0, dw1)
