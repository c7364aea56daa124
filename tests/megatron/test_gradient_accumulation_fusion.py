"""``config.gradient_accumulation_fusion`` under Megatron's DDP: the native FP8 wgrad of te_dist's experts adds into
``main_grad`` itself (te_dist.ops.basic.wgrad_accumulation) while ``te_dist.settings.megatron_main_grad_fusion`` is
on, and Megatron's hook adds nothing then.

On CPU the quantized GEMM's reference backend stands for the kernels (their epilogue add:
tests/kernels/test_fp8_grouped_gpu.py::test_accumulating_wgrad_adds_into_the_gradient); DDP's buffers hold what the
unfused run's hook would have added, bit for bit.
"""

import pytest
import torch

import mcore_helpers as H
import te_dist as td
from te_dist import kernels as K
from te_dist import recipe as R
from te_dist.ops import GroupedLinear


@pytest.fixture
def megatron_training_world1():
    H.apply_cpu_workarounds(training=True)  # Megatron's DDP on CPU
    H.init_megatron(ep_size=1)
    try:
        yield
    finally:
        H.destroy_megatron()
        H.undo_cpu_workarounds()


@pytest.fixture
def accumulators(monkeypatch):
    """The ``accumulate_into`` of every quantized wgrad call, in order; the native path taken on CPU."""
    monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: True)
    seen, real = [], K.grouped_mm_quantized_wgrad
    monkeypatch.setattr(K, "grouped_mm_quantized_wgrad",
                        lambda *a, accumulate_into=None, **k: seen.append(accumulate_into) or
                        real(*a, accumulate_into=accumulate_into, **k))
    return seen


def _main_grads(fusion: bool, overlap: bool, grad_in_fp32: bool, micro_batches: int = 2, switch: bool = True):
    """(main_grad of every parameter after ``micro_batches`` backwards under Megatron's DDP, the expert GEMMs)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(0)
    config = H.make_config(hidden_size=128, moe_ffn_hidden_size=128, num_moe_experts=2, params_dtype=torch.bfloat16,
                           bf16=True, gradient_accumulation_fusion=fusion)
    with td.settings.override(megatron_main_grad_fusion=switch):  # read when the experts are built
        layer = H.build_moe_layer(config, "te_dist", recipe=R.Float8CurrentScaling())
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_in_fp32, overlap_grad_reduce=overlap, bucket_size=None), layer)
    ddp.zero_grad_buffer()
    g = torch.Generator().manual_seed(3)
    for _ in range(micro_batches):
        y, _ = ddp(torch.randn(64, 2, 128, generator=g, dtype=torch.bfloat16))
        y.float().square().mean().backward()
    experts = [layer.experts.linear_fc1, layer.experts.linear_fc2]
    return {name: p.main_grad.clone() for name, p in layer.named_parameters()}, experts


@pytest.mark.parametrize("grad_in_fp32", [True, False], ids=["main_grad_f32", "main_grad_bf16"])
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap_grad_reduce"])
def test_the_expert_wgrads_go_into_main_grad_as_the_hook_would_add_them(megatron_training_world1, accumulators,
                                                                        grad_in_fp32, overlap):
    unfused, experts = _main_grads(False, overlap, grad_in_fp32)
    assert not any(op.fuse_wgrad_accumulation for op in experts) and accumulators == [None] * 4
    accumulators.clear()
    fused, experts = _main_grads(True, overlap, grad_in_fp32)
    assert all(op.fuse_wgrad_accumulation for op in experts)
    # every micro-batch, the first too (DDP's buffer is there from the start): fc2's backward runs before fc1's
    mains = [op.weight.main_grad for op in experts]
    assert len(accumulators) == 4 and all(a is mains[1 - i % 2] for i, a in enumerate(accumulators))
    assert all(op.weight.grad_added_to_main_grad and op.weight.grad is None for op in experts)
    assert fused.keys() == unfused.keys()
    for name in fused:
        assert torch.equal(fused[name], unfused[name]), name
    assert all(m.abs().sum() > 0 for m in mains)


def test_with_the_switch_off_the_config_flag_leaves_the_add_to_the_hook(megatron_training_world1, accumulators):
    """``megatron_main_grad_fusion`` off (the default until it runs on a GPU): the flag sets nothing."""
    assert not td.settings.current().megatron_main_grad_fusion
    grads, experts = _main_grads(True, False, True, switch=False)
    assert not any(op.fuse_wgrad_accumulation for op in experts) and accumulators == [None] * 4
    assert all(not getattr(op.weight, "grad_added_to_main_grad", False) for op in experts)
