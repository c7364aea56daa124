"""GPU (NCCL) versions of the Megatron tests: bf16, both dispatchers, tokens_per_expert on GPU and CPU.

Run on the device machine: ``python -m pytest -q -m gpu tests/megatron``. Skipped without CUDA.
"""

from pathlib import Path

import pytest
import torch

import mcore_helpers as H
from harness import run_torchrun

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).resolve().parent / "workers" / "ep2_moe.py"
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _bf16_config(**overrides):
    fields = dict(params_dtype=torch.bfloat16, bf16=True, hidden_size=128, moe_ffn_hidden_size=64, num_moe_experts=8,
                  moe_router_topk=2, moe_router_dtype="fp32")
    return H.make_config(**{**fields, **overrides})  # an override replaces a default (hidden_size, ...)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_gpu_moe_layer_matches_sequential_bf16(megatron_world1, dispatcher):
    config = _bf16_config(moe_token_dispatcher_type=dispatcher)
    seq = H.build_moe_layer(config, "sequential")
    ours = H.build_moe_layer(config, "te_dist")
    H.copy_moe_layer(seq, ours)
    x = torch.randn(64, 2, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    outs = []
    for layer in (seq, ours):
        xi = x.clone().requires_grad_(True)
        y, _ = layer(xi)
        y.backward(dy)
        outs.append((y.float(), xi.grad.float()))
    (y_ref, dx_ref), (y, dx) = outs
    scale = y_ref.abs().max()
    torch.testing.assert_close(y / scale, y_ref / scale, **BF16_TOL)
    torch.testing.assert_close(dx / dx_ref.abs().max(), dx_ref / dx_ref.abs().max(), **BF16_TOL)


def test_gpu_experts_accept_gpu_and_cpu_token_counts(megatron_world1):
    config = _bf16_config()
    ours = H.build_moe_layer(config, "te_dist")
    counts_cpu = torch.tensor([5, 0, 3, 0, 8, 1, 0, 3])
    x = torch.randn(20, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(20, device="cuda")
    y_cpu, _ = ours.experts(x, counts_cpu, probs)
    y_gpu, _ = ours.experts(x, counts_cpu.cuda(), probs)
    torch.testing.assert_close(y_gpu, y_cpu, rtol=0, atol=0)
    assert torch.isfinite(y_gpu.float()).all()


def test_gpu_transformer_layer_forward_backward(megatron_world1):
    from megatron.core.transformer.spec_utils import build_module

    import te_dist.megatron as tm

    config = _bf16_config()
    # bf16 like Megatron's Float16Module: the Torch-norm fallback (no Apex) builds fp32 norm weights.
    layer = build_module(tm.gpt_layer_spec(), config=config, layer_number=1).cuda().bfloat16()
    x = torch.randn(32, 2, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.triu(torch.ones(2, 1, 32, 32, dtype=torch.bool, device="cuda"), diagonal=1)
    y, _ = layer(x, attention_mask=mask)
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad.float()).all()
    assert layer.mlp.experts.linear_fc1.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("recipe", ["block", "current"])
def test_gpu_padded_rows_take_the_native_fp8_path(megatron_world1, recipe):
    """``settings.megatron_row_padding`` on: unaligned rows per expert run the native FP8 kernels (the
    weight copy is cast) and agree with the emulated path the switch-off run takes."""
    import te_dist

    config = _bf16_config(hidden_size=256, moe_ffn_hidden_size=128)
    ours = H.build_moe_layer(config, "te_dist", recipe=recipe)
    counts = torch.tensor([37, 0, 130, 5, 1, 64, 0, 19])
    x = torch.randn(int(counts.sum()), config.hidden_size, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(x.shape[0], device="cuda")
    runs = {}
    for padding in (False, True):
        with te_dist.settings.override(megatron_row_padding=padding):
            ours.experts.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            y, _ = ours.experts(xi, counts, probs)
            y.float().square().sum().backward()
            runs[padding] = (y.float(), xi.grad.float(), ours.experts.linear_fc1.weight.grad.float())
        assert ours.experts.linear_fc1.has_native_weight_copy == padding
    # Relative Frobenius: the two paths round different intermediates, so a few elements near an FP8 rounding
    # boundary land a step apart. 5% where the gradients are E4M3 (block), twice that where current scaling
    # casts them to E5M2 (HYBRID: twice the rounding step).
    bound = 1e-1 if recipe == "current" else 5e-2
    for name, native, emulated in zip(("y", "dx", "dW1"), runs[True], runs[False]):
        rel = ((native - emulated).norm() / emulated.norm()).item()
        assert rel < bound, (name, rel)


@pytest.mark.parametrize("grad_in_fp32", [True, False], ids=["main_grad_f32", "main_grad_bf16"])
def test_gpu_gradient_accumulation_fusion_adds_fp8_wgrads_into_main_grad(megatron_world1, monkeypatch, grad_in_fp32):
    """Native FP8 experts under Megatron's DDP, two micro-batches: with ``gradient_accumulation_fusion`` the expert
    wgrads go into ``main_grad`` in the kernels' epilogue (every micro-batch; the mark set, no ``.grad`` left), and
    DDP's buffers agree with the unfused run's, whose hook adds the rounded products, within their rounding."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import te_dist
    from te_dist import kernels as K
    from te_dist import recipe as R

    seen, real = [], K.grouped_mm_quantized_wgrad
    monkeypatch.setattr(K, "grouped_mm_quantized_wgrad", lambda *a, accumulate_into=None, **k:
                        seen.append(accumulate_into) or real(*a, accumulate_into=accumulate_into, **k))
    runs = {}
    for fusion in (False, True):
        torch.manual_seed(0)
        config = _bf16_config(hidden_size=256, moe_ffn_hidden_size=256, gradient_accumulation_fusion=fusion)
        with te_dist.settings.override(megatron_main_grad_fusion=True):
            layer = H.build_moe_layer(config, "te_dist", recipe=R.Float8CurrentScaling())
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_in_fp32, overlap_grad_reduce=True, bucket_size=None), layer)
        ddp.zero_grad_buffer()
        seen.clear()
        g = torch.Generator(device="cuda").manual_seed(3)
        for _ in range(2):
            y, _ = ddp(torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16, generator=g))
            y.float().square().mean().backward()
        experts = (layer.experts.linear_fc1, layer.experts.linear_fc2)
        assert all(op.has_native_weight_copy for op in experts)
        mains = [op.weight.main_grad for op in experts]
        if fusion:
            assert len(seen) == 4 and all(any(a is m for m in mains) for a in seen)
            assert all(op.weight.grad_added_to_main_grad and op.weight.grad is None for op in experts)
        else:
            assert seen == [None] * 4
        runs[fusion] = [m.float().clone() for m in mains]
    for fused, unfused in zip(runs[True], runs[False]):
        assert unfused.norm() > 0 and ((fused - unfused).norm() / unfused.norm()).item() < 1e-2


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_gpu_ep2_nccl_matches_sequential(tmp_path, megatron_world1, dispatcher):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    run_torchrun(WORKER, 2, args=(tmp_path, dispatcher), timeout=300).check()
    run_torchrun(WORKER, 2, args=(tmp_path / "recipe", dispatcher, "current"), timeout=300).check()
