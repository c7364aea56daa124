"""GPU checks of the fusible ops (skipped without CUDA; the lead runs them on an H200)."""

import copy

import pytest
import torch

import te_dist
from te_dist import ops

pytestmark = pytest.mark.gpu


def _mlp(E, H, F, dtype, device, bias=True):
    torch.manual_seed(0)
    fuser = ops.OperationFuser([
        ops.GroupedLinear(E, H, 2 * F, bias=bias, dtype=dtype, device=device),
        ops.ScaledSwiGLU(),
        ops.GroupedLinear(E, F, H, bias=bias, dtype=dtype, device=device),
    ])
    if bias:
        with torch.no_grad():
            for i in (0, 2):
                fuser.basic_ops[i].bias.normal_()
    return fuser


def _run(fuser, x, splits, probs, dy, recipe=None):
    x = x.detach().requires_grad_(True)
    probs = probs.detach().requires_grad_(True)
    with te_dist.autocast(recipe=recipe):
        y = fuser(x, splits, probs, splits)
    y.backward(dy)
    return [y, x.grad, probs.grad] + [p.grad for p in fuser.parameters()]


def test_grouped_mlp_cuda_bf16_matches_cpu_fp32(cuda_device):
    E, H, F = 4, 256, 128
    cpu = _mlp(E, H, F, torch.float32, "cpu")
    gpu = copy.deepcopy(cpu).to(device=cuda_device, dtype=torch.bfloat16)
    splits = torch.tensor([96, 0, 160, 64])  # a zero-row expert included
    T = int(splits.sum())
    x, probs, dy = torch.randn(T, H), torch.rand(T), torch.randn(T, H)
    ref = _run(cpu, x, splits, probs, dy)
    out = _run(gpu, x.to(cuda_device, torch.bfloat16), splits.to(cuda_device), probs.to(cuda_device),
               dy.to(cuda_device, torch.bfloat16))
    assert type(gpu.plan.forward_ops[0].op).__name__ == "GroupedMLP"
    for a, b in zip(out, ref):
        # bf16 against fp32: a norm-wise relative error (an elementwise bound trips on cancellations).
        a = a.float().cpu()
        assert torch.isfinite(a).all()
        assert (a - b).norm() / b.norm() < 1e-2


def test_grouped_mlp_device_split_sizes_do_not_sync(cuda_device):
    E, H, F = 4, 256, 128
    fuser = _mlp(E, H, F, torch.bfloat16, cuda_device, bias=False)
    splits = torch.full((E,), 128, device=cuda_device, dtype=torch.int64)
    T = 128 * E
    x = torch.randn(T, H, device=cuda_device, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device=cuda_device, requires_grad=True)
    fuser(x, splits, probs, splits).sum().backward()  # warm-up (plan build, backend load)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = fuser(x, splits, probs, splits)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_sequential_cuda_matches_cpu(cuda_device):
    torch.manual_seed(1)
    cpu = ops.Sequential(ops.BasicLinear(64, 128), ops.Bias(128), ops.GELU(), ops.BasicLinear(128, 64))
    gpu = copy.deepcopy(cpu).to(cuda_device)
    x = torch.randn(16, 64)
    torch.testing.assert_close(gpu(x.to(cuda_device)).cpu(), cpu(x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["current", "block", "mxfp8"])
def test_fused_matches_unfused_under_recipe_cuda(cuda_device, name):
    from te_dist.recipe import recipe_from_name

    E, H, F = 2, 128, 128
    base = _mlp(E, H, F, torch.bfloat16, cuda_device)
    splits = torch.tensor([128, 128], device=cuda_device)
    T = 256
    x = torch.randn(T, H, device=cuda_device, dtype=torch.bfloat16)
    probs, dy = torch.rand(T, device=cuda_device), torch.randn(T, H, device=cuda_device, dtype=torch.bfloat16)
    recipe = recipe_from_name(name)
    recipe.fp8_swiglu_input = False  # the fused MLP keeps h in bf16 as the unfused ops do (see the test below)
    fused = _run(copy.deepcopy(base), x, splits, probs, dy, recipe)
    with ops.fusion_rules_scope(disable=("forward_grouped_mlp", "backward_grouped_mlp")):
        unfused = _run(copy.deepcopy(base), x, splits, probs, dy, recipe)
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=1e-1)


@pytest.mark.parametrize("rows,ffn,limit,dtype", [
    (512, 14336, None, torch.bfloat16),   # Mixtral-like fc2 input width
    (1000, 2048, None, torch.bfloat16),   # DeepSeek-like, a row count that is no power of two
    (37, 40, 0.75, torch.float32),        # limit clamps, a partial column block
    (0, 64, None, torch.bfloat16),        # an empty step
])
def test_scaled_swiglu_backward_triton_kernel_matches_the_fp32_function(cuda_device, rows, ffn, limit, dtype):
    pytest.importorskip("triton")
    from te_dist.ops.basic import swiglu, swiglu_triton

    g = torch.Generator(device=cuda_device).manual_seed(rows + ffn)
    h = (2 * torch.randn(rows, 2 * ffn, device=cuda_device, generator=g)).to(dtype)
    da = torch.randn(rows, ffn, device=cuda_device, generator=g).to(dtype)
    probs = torch.rand(rows, device=cuda_device, generator=g)
    got = swiglu_triton.scaled_swiglu_backward(da, h, probs, limit)
    want = swiglu._scaled_swiglu_backward_eager(da.double(), h.double(), probs.double(), limit)
    names = ("dh", "dprobs", "scaled")
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # one rounding to bf16 at the end
        # (the reference computes in fp32, as the kernel does; dh and the scaled output are then rounded once)
        torch.testing.assert_close(a.double(), b.to(a.dtype).double(), rtol=tol,
                                   atol=tol * (ffn ** 0.5 if name == "dprobs" else 1.0),
                                   msg=lambda m: f"{name}: {m}")
    assert got[0].dtype == dtype and got[1].dtype == torch.float32 and got[2].dtype == dtype
    # The grouped MLP's backward takes this kernel on CUDA (compilation enabled by default there).
    seen = []
    original = swiglu_triton.scaled_swiglu_backward
    swiglu_triton.scaled_swiglu_backward = lambda *a, **kw: seen.append(1) or original(*a, **kw)
    try:
        swiglu.scaled_swiglu_backward(da, h, probs, limit)
    finally:
        swiglu_triton.scaled_swiglu_backward = original
    assert seen == [1]


@pytest.mark.parametrize("rows,ffn,limit,dtype", [
    (512, 1792, None, torch.bfloat16),  # 14 blocks per half: a partial step of 4 blocks
    (300, 128, 7.0, torch.bfloat16),    # one block per half, the limit clamps
    (64, 384, None, torch.float32),
    (0, 256, None, torch.bfloat16),     # an empty step
])
def test_scaled_swiglu_forward_keeping_fp8_input(cuda_device, rows, ffn, limit, dtype):
    """One pass gives swiglu(h) * p and h's FP8 copy: the copy has the bytes and scales of the 1x128
    E4M3 block cast (power-of-two scales), and the backward from the copy equals the backward from
    the dequantized copy (the probability gradient up to its sum's order: the two launch differently)."""
    pytest.importorskip("triton")
    from te_dist.ops.basic import swiglu, swiglu_triton
    from te_dist.quantization import triton_casts

    g = torch.Generator(device=cuda_device).manual_seed(rows + ffn)
    h = (3 * torch.randn(rows, 2 * ffn, device=cuda_device, generator=g)).to(dtype)
    if rows:
        h[0, :128] = 0  # an all-zero block: scale 1
        h[1, 5] = 2.0e4  # a block with a large value
    probs = torch.rand(rows, device=cuda_device, generator=g)
    scaled, kept = swiglu.scaled_swiglu_forward_keeping_fp8(h, probs, limit)
    ref_data, ref_scale_inv, _, _ = triton_casts.cast_fp8_blocks(h, 1, 128, torch.float8_e4m3fn, 448.0, True)
    assert torch.equal(kept.data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(kept.scale_inv, ref_scale_inv) and kept.dtype == dtype
    want = swiglu._scaled_swiglu_forward_kernel(h.double(), probs.double(), limit)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(scaled.double(), want.to(dtype).double(), rtol=tol, atol=tol)
    da = torch.randn(rows, ffn, device=cuda_device, generator=g).to(dtype)
    got = swiglu.scaled_swiglu_backward(da, kept, probs, limit)
    from_dequantized = swiglu_triton.scaled_swiglu_backward(da, kept.dequantize(), probs, limit)
    for name, a, b in zip(("dh", "dprobs", "scaled"), got, from_dequantized):
        assert a.dtype == b.dtype, name
        if name == "dprobs":  # one float32 sum per row over F products, in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()) if rows else 0.0)
        else:
            assert torch.equal(a, b), name
