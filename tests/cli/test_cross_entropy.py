"""te-dist train's loss (te_dist/train/cross_entropy.py) and optimizer choice.

The fused kernels run three ways: on CUDA (``-m gpu``), in Triton's interpreter on CPU tensors (needs triton and
``TRITON_INTERPRET=1`` set before Triton is imported, else skipped: CI has no Triton), and never on plain CPU
tensors, where the reference path runs (checked here without Triton)."""

import os

import pytest
import torch
import torch.nn.functional as F

from te_dist.train import cross_entropy as ce
from te_dist.train.loop import _optimizer_impl

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and INTERPRET),
                                       reason="Triton interpreter run: needs triton and TRITON_INTERPRET=1")

# vocabularies below one block, over several blocks with a ragged tail, and a float32 one
SHAPES = [(5, 37, torch.bfloat16), (3, 9000, torch.bfloat16), (4, 100, torch.float32), (6, 4096, torch.float16)]


def _logits(T, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, V, generator=g) * 4).to(device=device, dtype=dtype).requires_grad_(True)
    y = torch.randint(0, V, (T,), generator=g).to(device)
    return x, y


def _check_fused(device, apply):
    for T, V, dtype in SHAPES:
        x, y = _logits(T, V, dtype, device)
        ref = F.cross_entropy(x.float(), y)
        ref.backward(torch.tensor(2.0, device=device))
        ref_grad, x.grad = x.grad.clone(), None
        got = apply(x, y)
        got.backward(torch.tensor(2.0, device=device))
        assert got.dtype == torch.float32
        assert got.item() == pytest.approx(ref.item(), rel=1e-5), (T, V, dtype)
        assert x.grad.dtype == dtype
        # one rounding of the same float32 gradient, computed in another order
        ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -20}[dtype]
        assert (x.grad.float() - ref_grad.float()).abs().max().item() <= ulp * ref_grad.abs().max().item(), (T, V)


@needs_interpreter
def test_fused_kernels_match_the_reference_in_the_interpreter():
    _check_fused(torch.device("cpu"), ce._FusedCrossEntropy.apply)


@needs_interpreter
def test_a_target_outside_the_vocabulary_gives_a_nan_loss_in_the_interpreter():
    x, y = _logits(3, 37, torch.bfloat16, torch.device("cpu"))
    for bad in (37, -100):
        y[1] = bad
        assert torch.isnan(ce._FusedCrossEntropy.apply(x, y)), bad


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_fused_kernels_match_the_reference_on_cuda(cuda_device):
    _check_fused(cuda_device, lambda x, y: ce.cross_entropy(x, y, fused=True))
    x, y = _logits(4, 300, torch.bfloat16, cuda_device)
    assert ce.fused_available(x) and not ce.fused_available(x.detach().t())


def test_cpu_logits_take_the_reference_path_either_way():
    x, y = _logits(5, 37, torch.bfloat16, torch.device("cpu"))
    assert not ce.fused_available(x)
    for fused in (True, False):
        assert torch.equal(ce.cross_entropy(x, y, fused=fused), F.cross_entropy(x.float(), y))


def test_bad_shapes_are_named_before_any_kernel():
    x, y = _logits(5, 37, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"logits \[T, V\] and targets \[T\], received \(5, 37\) and \(4,\)"):
        ce.cross_entropy(x, y[:4])
    with pytest.raises(ValueError, match="received"):
        ce.cross_entropy(x[None], y)


def test_optimizer_implementation_per_device():
    assert _optimizer_impl(torch.device("cuda", 0), True) == {"fused": True}
    assert _optimizer_impl(torch.device("cuda", 0), False) == {"foreach": True}
    assert _optimizer_impl(torch.device("cpu"), True) == {"foreach": False}  # the plain loop: reproducible CPU runs
