"""GroupedLinear.fuse_wgrad_accumulation: the native FP8 wgrad adds into an existing ``weight.grad`` or Megatron's
``main_grad`` itself (te_dist.ops.basic.wgrad_accumulation).

What a later micro-batch's backward leaves in ``.grad`` is what autograd's own in-place add leaves, bit for bit (on
CPU the quantized GEMM's reference backend; the CUTLASS epilogue's add is the GPU test of
``tests/kernels/test_fp8_grouped_gpu.py``), and the op hands autograd no weight gradient then; ``main_grad`` holds
what Megatron's hook would have added. Where autograd's add would not be in place, or the gradient is not the
weight's own layout, the op leaves the add to autograd.
"""

import pytest
import torch

import te_dist as td
from te_dist import kernels as K
from te_dist import recipe as R
from te_dist.ops import GroupedLinear, OperationFuser

RECIPES = [R.Float8CurrentScaling(), R.Float8BlockScaling(), R.DelayedScaling()]
SIZES = (128, 0, 256)


@pytest.fixture(autouse=True)
def native(monkeypatch):
    monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: True)


@pytest.fixture
def accumulators(monkeypatch):
    """The ``accumulate_into`` of every quantized wgrad call, in order."""
    seen = []
    real = K.grouped_mm_quantized_wgrad
    monkeypatch.setattr(K, "grouped_mm_quantized_wgrad",
                        lambda *a, accumulate_into=None, **k: seen.append(accumulate_into) or
                        real(*a, accumulate_into=accumulate_into, **k))
    return seen


def _op(in_features=256, out_features=128, fuse=False):
    torch.manual_seed(0)
    op = GroupedLinear(3, in_features, out_features, dtype=torch.bfloat16)
    op.fuse_wgrad_accumulation = fuse
    return op


def _micro_batches(op, recipe, count=3, in_features=256, first=0):
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(10 + i)
        x = torch.randn(sum(SIZES), in_features, dtype=torch.bfloat16, generator=g).requires_grad_()
        with td.autocast(recipe=recipe):
            y = OperationFuser([op])(x, torch.tensor(SIZES))
        assert op.has_native_weight_copy
        y.float().square().mean().backward()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("in_epilogue", [False, True])
def test_later_micro_batches_add_into_the_gradient_as_autograd_would(recipe, in_epilogue, accumulators):
    plain = _op()
    _micro_batches(plain, recipe)
    assert accumulators == [None] * 3  # off: autograd adds
    accumulators.clear()
    fused = _op(fuse=True)
    with td.settings.override(fp8_wgrad_accumulation=in_epilogue):  # on CPU the reference backend adds alike
        _micro_batches(fused, recipe, count=1)
        grad = fused.weight.grad
        _micro_batches(fused, recipe, count=2, first=1)
    # the first micro-batch finds no gradient and hands its own to autograd; the later ones add into it
    assert accumulators[0] is None and all(acc is grad for acc in accumulators[1:]) and len(accumulators) == 3
    assert fused.weight.grad is grad
    assert torch.equal(fused.weight.grad, plain.weight.grad)


def test_autograd_adds_where_the_gradient_is_not_the_weights_layout(accumulators):
    op = _op(fuse=True)
    op.weight.grad = torch.zeros(3, 256, 128, dtype=torch.bfloat16).transpose(1, 2)  # [E, N, K], not contiguous
    _micro_batches(op, R.Float8BlockScaling(), count=1)
    assert accumulators == [None]
    reference = _op()
    _micro_batches(reference, R.Float8BlockScaling(), count=1)
    assert torch.equal(op.weight.grad, reference.weight.grad)


def test_off_grid_block_weights_leave_the_add_to_autograd(accumulators):
    """The padded path's gradient is a view of the padded product: its add stays autograd's."""
    op, reference = _op(in_features=192, fuse=True), _op(in_features=192)
    for each in (op, reference):
        _micro_batches(each, R.Float8BlockScaling(), count=2, in_features=192)
    assert accumulators == [None] * 4
    assert torch.equal(op.weight.grad, reference.weight.grad)


def _quantized(recipe, T=256, K_=128, N=256):
    from te_dist.quantization import make_quantizer

    g = torch.Generator().manual_seed(3)
    x, dy = (torch.randn(T, n, dtype=torch.bfloat16, generator=g) for n in (K_, N))
    qi, qg = make_quantizer(recipe, "input"), make_quantizer(recipe, "grad_output")
    return qi(x, rowwise=True, columnwise=True), qg(dy, rowwise=True, columnwise=True), \
        torch.tensor([128, 128, 256], dtype=torch.int32)


@pytest.mark.parametrize("bad, received", [
    (torch.zeros(3, 256, 64, dtype=torch.bfloat16), r"received \(3, 256, 64\) torch.bfloat16 on cpu"),
    (torch.zeros(3, 256, 128, dtype=torch.float16), r"received \(3, 256, 128\) torch.float16 on cpu"),
    (torch.zeros(3, 128, 256, dtype=torch.bfloat16).transpose(1, 2),
     r"received \(3, 256, 128\) torch.bfloat16 on cpu, not contiguous"),
    ([0.0], "received list"),
])
def test_accumulate_into_is_checked_before_any_work(bad, received):
    xq, dyq, offsets = _quantized(R.Float8BlockScaling())
    with pytest.raises(ValueError, match=r"accumulate_into must be a contiguous \(3, 256, 128\) torch.bfloat16 or "
                                         rf"float32 tensor on cpu, {received}"):
        K.grouped_mm_quantized_wgrad(xq, dyq, offsets, num_groups=3, accumulate_into=bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accumulate_into_returns_the_tensor_given_holding_the_sum(dtype):
    xq, dyq, offsets = _quantized(R.Float8CurrentScaling())
    dw = K.grouped_mm_quantized_wgrad(xq, dyq, offsets, num_groups=3)
    old = torch.randn(3, 256, 128, dtype=dtype)
    acc = old.clone()
    out = K.grouped_mm_quantized_wgrad(xq, dyq, offsets, num_groups=3, accumulate_into=acc)
    assert out is acc and out.dtype == dtype and torch.equal(out, old + dw)  # float32: the bf16 product added


@pytest.mark.parametrize("switch", [False, True])
def test_an_add_in_the_epilogue_keeps_the_wgrad_off_cublas_per_expert(monkeypatch, switch):
    """The accumulating wgrad asks the rule for an epilogue, which the per-expert loop cannot run (Mixtral-like's
    wgrads go to the loop otherwise, and add after it)."""
    from te_dist.gemm import decide

    seen, real = [], decide.choose_quantized
    monkeypatch.setattr(decide, "choose_quantized", lambda *a, **k: seen.append(k["epilogue"]) or real(*a, **k))
    xq, dyq, offsets = _quantized(R.Float8CurrentScaling())
    with td.settings.override(fp8_wgrad_accumulation=switch):
        K.grouped_mm_quantized_wgrad(xq, dyq, offsets, num_groups=3,
                                     accumulate_into=torch.zeros(3, 256, 128, dtype=torch.bfloat16))
        K.grouped_mm_quantized_wgrad(xq, dyq, offsets, num_groups=3)
    assert seen == [switch, False]


def test_the_accumulating_kernels_are_their_own_instances():
    from cutlass_kernels.fp8_block import Fp8Instance, all_fp8_instances

    plain, acc = Fp8Instance("wgrad", 11), Fp8Instance("wgrad", 11, accumulate=True)
    assert acc.name == plain.name + "_acc" and "-DTE_FB_ACCUMULATE=1" in acc.macros
    assert "-DTE_FB_ACCUMULATE=0" in plain.macros
    built = [i for i in all_fp8_instances() if i.accumulate]
    assert {(i.direction, i.a_format, i.tensor_scales, i.out_f32) for i in built} == {  # float32: main_grad
        ("wgrad", f, t, o) for f in ("e4m3", "e5m2") for t in (False, True) for o in (False, True)}


def test_te_dist_train_sets_it_on_its_experts_while_the_switch_is_on():
    from te_dist.train.loop import fuse_expert_wgrad_accumulation

    model = torch.nn.Sequential(_op(), torch.nn.Linear(4, 4), torch.nn.ModuleList([_op()]))
    experts = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    fuse_expert_wgrad_accumulation(model)  # the default: on
    assert len(experts) == 2 and all(m.fuse_wgrad_accumulation for m in experts)
    with td.settings.override(fp8_wgrad_accumulation=False):
        fuse_expert_wgrad_accumulation(model)
    assert not any(m.fuse_wgrad_accumulation for m in experts)


@pytest.mark.parametrize("how", ["autograd_grad_of_x", "autograd_grad_of_w", "backward_inputs_x"])
def test_a_backward_that_adds_nothing_into_grad_leaves_it_alone(how, accumulators):
    """Only a backward that accumulates into ``.grad`` gets the op's add: autograd.grad returns its results, and
    backward(inputs=...) without the weight leaves the weight's gradient as it was."""
    op = _op(fuse=True)
    _micro_batches(op, R.Float8CurrentScaling(), count=1)
    before = op.weight.grad.clone()
    accumulators.clear()
    x = torch.randn(sum(SIZES), 256, dtype=torch.bfloat16).requires_grad_()
    with td.autocast(recipe=R.Float8CurrentScaling()):
        loss = OperationFuser([op])(x, torch.tensor(SIZES)).float().square().mean()
    if how == "autograd_grad_of_x":
        torch.autograd.grad(loss, x)
    elif how == "autograd_grad_of_w":
        (dw,) = torch.autograd.grad(loss, op.weight)
        assert dw.abs().sum() > 0
    else:
        loss.backward(inputs=[x])
    assert accumulators == [None] or (how == "autograd_grad_of_x" and accumulators == [])
    assert torch.equal(op.weight.grad, before)


def _megatron_main_grad(op, dtype):
    """``op.weight`` as Megatron's DDP leaves it: a ``main_grad`` buffer and its hook, which adds a ``.grad`` not marked
    added into it, then drops the ``.grad``."""
    op.weight.main_grad = torch.zeros(op.weight.shape, dtype=dtype)

    def hook(p):
        if p.grad is not None and not getattr(p, "grad_added_to_main_grad", False):
            p.main_grad.add_(p.grad)
        p.grad = None

    op.weight.register_post_accumulate_grad_hook(hook)
    return op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_main_grad_takes_every_micro_batch_wgrad_as_the_hook_would_add_it(dtype, accumulators):
    plain, fused = _megatron_main_grad(_op(), dtype), _megatron_main_grad(_op(fuse=True), dtype)
    _micro_batches(plain, R.Float8BlockScaling())
    assert accumulators == [None] * 3
    accumulators.clear()
    _micro_batches(fused, R.Float8BlockScaling())
    assert len(accumulators) == 3 and all(a is fused.weight.main_grad for a in accumulators)  # the first one too
    assert fused.weight.grad_added_to_main_grad and fused.weight.grad is None
    assert torch.equal(fused.weight.main_grad, plain.weight.main_grad) and plain.weight.main_grad.abs().sum() > 0


def test_a_backward_off_the_native_path_leaves_the_add_to_the_hook(monkeypatch, accumulators):
    """An earlier micro-batch's mark is cleared where the wgrad goes to autograd again (here the emulated path)."""
    recipe, ops = R.Float8CurrentScaling(), [_megatron_main_grad(_op(fuse=f), torch.float32) for f in (False, True)]
    for op in ops:
        _micro_batches(op, recipe, count=1)
    assert ops[1].weight.grad_added_to_main_grad
    monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: False)
    for op in ops:
        x = torch.randn(sum(SIZES), 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
        with td.autocast(recipe=recipe):
            OperationFuser([op])(x, torch.tensor(SIZES)).float().square().mean().backward()
    assert accumulators == [None, ops[1].weight.main_grad]  # the native micro-batches alone
    assert not ops[1].weight.grad_added_to_main_grad
    assert torch.equal(ops[1].weight.main_grad, ops[0].weight.main_grad)
