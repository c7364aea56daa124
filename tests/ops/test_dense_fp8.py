"""BasicLinear's native FP8 path (``te_dist.settings.fp8_dense_native``): the dense GEMM as one group of
the quantized grouped kernels.

On CPU the native branch is forced (on a GPU the support predicate decides) and its GEMMs run on the
quantized entry points' emulated backend, which multiplies the same quantized operands the kernels
read. A one-group GroupedLinear on its native path computes the same thing through the same
functions, so the dense layer is compared with it bit for bit; with the emulated dense layer (other
math: wgrad operands quantized along the features) with a tolerance.
"""

import pytest
import torch

import te_dist as td
from te_dist import recipe as R
from te_dist.ops import BasicLinear, Bias, GroupedLinear, OperationFuser
from te_dist.ops.basic.dense_fp8 import DenseFP8
from te_dist.ops.basic.weight_copy import set_first_microbatch

RECIPES = [R.Float8CurrentScaling, R.DelayedScaling, R.Float8BlockScaling]
ROWS = 256  # a multiple of every recipe's row alignment (block: 128)


def _name(recipe_type):
    return recipe_type.__name__


@pytest.fixture
def forced_native(monkeypatch):
    monkeypatch.setattr(DenseFP8, "applies", staticmethod(lambda op, x2: True))
    monkeypatch.setattr(GroupedLinear, "native_path", lambda self, *a, **k: True)


def _pair(k=256, n=384, bias=False, seed=0):
    """A dense layer (with a Bias op when ``bias``) and a one-group GroupedLinear holding the same weights."""
    torch.manual_seed(seed)
    dense = BasicLinear(k, n, dtype=torch.bfloat16)
    grouped = GroupedLinear(1, k, n, bias=bias, dtype=torch.bfloat16)
    ops = [dense]
    with torch.no_grad():
        grouped.weight.copy_(dense.weight.unsqueeze(0))
        if bias:
            b = Bias(n, dtype=torch.bfloat16)
            b.bias.normal_()
            grouped.bias.copy_(b.bias.unsqueeze(0))
            ops.append(b)
    return ops, grouped


def _step(fuser_ops, x, dy, recipe, *extra):
    x = x.detach().clone().requires_grad_(True)
    with td.autocast(recipe=recipe):
        y = OperationFuser(fuser_ops)(x, *extra)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("recipe_type", RECIPES, ids=_name)
def test_dense_native_equals_the_one_group_grouped_layer(forced_native, copies, recipe_type, bias):
    """Output, dx and dW (and dbias through the fused bias) bit for bit against GroupedLinear(1, ...)
    on its native path; the copy is cast as a [1, N, K] stack at every forward (no micro-batch flag)."""
    ops, grouped = _pair(bias=bias)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 256, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(ROWS, 384, dtype=torch.bfloat16, generator=g)
    for step in range(2):  # DelayedScaling: the second step casts with the first one's amax
        for op in ops + [grouped]:
            op.zero_grad(set_to_none=True)
        y, dx = _step(ops, x, dy, recipe_type())
        y_g, dx_g = _step([grouped], x, dy, recipe_type(), torch.tensor([ROWS]))
        assert torch.equal(y, y_g), step
        assert torch.equal(dx, dx_g), step
        assert ops[0].weight.grad.shape == (384, 256) and torch.equal(ops[0].weight.grad, grouped.weight.grad[0])
        if bias:
            assert torch.equal(ops[1].bias.grad, grouped.bias.grad[0]), step
    assert ops[0].has_native_weight_copy
    assert copies == [(1, 384, 256)] * 4  # each forward of the two layers in the two steps casts once


@pytest.mark.parametrize("recipe_type", RECIPES, ids=_name)
def test_dense_native_is_close_to_the_emulated_dense_layer(monkeypatch, recipe_type):
    """Against the emulated path of the same layer (its reference): other math, so a tolerance; the
    second step is compared (DelayedScaling's emulated first cast uses the initial scale)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, ROWS // 2, 256, dtype=torch.bfloat16, generator=g)  # [B, S, K]: rows are flattened
    dy = torch.randn(2, ROWS // 2, 384, dtype=torch.bfloat16, generator=g)
    results = {}
    for native in (True, False):
        monkeypatch.setattr(DenseFP8, "applies", staticmethod(lambda op, x2, native=native: native))
        ops, _ = _pair()
        recipe = recipe_type()
        for _ in range(2):
            ops[0].zero_grad(set_to_none=True)
            y, dx = _step(ops, x, dy, recipe)
        results[native] = (y, dx, ops[0].weight.grad)
        assert ops[0].has_native_weight_copy == native
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    for got, want in zip(results[True], results[False]):
        assert got.shape == want.shape and rel(got, want) < 0.08


def test_the_micro_batch_flag_keeps_the_copy_for_the_step(forced_native, copies):
    """True casts and keeps, False reuses (no cast), None casts every forward; an optimizer step ends the reuse."""
    ops, _ = _pair()
    dense = ops[0]
    x = torch.randn(ROWS, 256, dtype=torch.bfloat16)
    dy = torch.randn(ROWS, 384, dtype=torch.bfloat16)
    opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    set_first_microbatch(dense, True)
    for _ in range(3):
        _step(ops, x, dy, R.Float8CurrentScaling())
    assert len(copies) == 1 and dense.is_first_microbatch is False
    opt.step()
    _step(ops, x, dy, R.Float8CurrentScaling())  # still False, but the weights changed
    assert len(copies) == 2
    set_first_microbatch(dense, None)
    _step(ops, x, dy, R.Float8CurrentScaling())
    _step(ops, x, dy, R.Float8CurrentScaling())
    assert len(copies) == 4


def test_the_path_is_taken_only_where_it_can_run():
    """Switched off, nothing takes it; on (the default), a CPU tensor or features off the 128 grid run
    the emulated path (the CUDA answer is the support predicate's: this file's GPU test)."""
    dense = BasicLinear(256, 384, dtype=torch.bfloat16)
    dense.reset_recipe_state(R.Float8CurrentScaling())
    x2 = torch.randn(ROWS, 256, dtype=torch.bfloat16)
    assert td.settings.current().fp8_dense_native is True
    with td.settings.override(fp8_dense_native=False):
        assert not DenseFP8.applies(dense, x2)
    with td.settings.override(fp8_dense_native=True):
        assert not DenseFP8.applies(dense, x2)  # a CPU tensor
        off_grid = BasicLinear(200, 384, dtype=torch.bfloat16)
        off_grid.reset_recipe_state(R.Float8CurrentScaling())
        assert not DenseFP8.applies(off_grid, torch.randn(ROWS, 200, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_type", RECIPES, ids=_name)
def test_gpu_dense_native_runs_the_kernels_and_matches_the_emulated_layer(recipe_type):
    """On a GPU where the FP8 kernels run: the switch on takes the native path (the copy is cast) and
    stays within the emulated layer's tolerance."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(4, 512, 1024, dtype=torch.bfloat16, device=dev, generator=g)
    dy = torch.randn(4, 512, 768, dtype=torch.bfloat16, device=dev, generator=g)
    results = {}
    for native in (True, False):
        torch.manual_seed(0)
        ops = [BasicLinear(1024, 768, dtype=torch.bfloat16, device=dev)]
        with td.settings.override(fp8_dense_native=native):
            for _ in range(2):
                ops[0].zero_grad(set_to_none=True)
                y, dx = _step(ops, x, dy, recipe_type())
        assert ops[0].has_native_weight_copy == native
        results[native] = (y, dx, ops[0].weight.grad)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    for got, want in zip(results[True], results[False]):
        assert torch.isfinite(got).all() and rel(got, want) < 0.08
