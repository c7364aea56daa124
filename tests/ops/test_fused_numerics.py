"""Fused ops match the basic ops they replace and a float64 reference, forward and backward,
for no recipe and for each recipe."""

import copy

import pytest
import torch

import te_dist
from te_dist import ops
from te_dist.ops.fused import default_fusion_rules
from ops_reference import RECIPE_NAMES, assert_close, make_recipe, ref_grouped_linear, ref_linear, ref_swiglu

RECIPES = [pytest.param(n, id=n) for n in RECIPE_NAMES]
ALL_RULES = tuple(r.name for r in default_fusion_rules())


def leaf64(t):
    return t.detach().double().requires_grad_(True)


def run(fuser, x, extra, recipe, dy, *, fused: bool):
    """Run fwd+bwd on a fresh copy of ``fuser`` (fresh recipe state: DelayedScaling's amax history
    moves on every call) with all default rules (fused) or none (unfused); return outputs and grads."""
    fuser = copy.deepcopy(fuser)
    x = x.detach().requires_grad_(True)
    extra = [e.detach().requires_grad_(True) if e.is_floating_point() else e for e in extra]
    disable = () if fused else ALL_RULES
    with ops.fusion_rules_scope(disable=disable), te_dist.autocast(recipe=recipe):
        y = fuser(x, *extra)
    y.backward(dy)
    names = [type(s.op).__name__ for s in fuser.plan.forward_ops + fuser.plan.backward_ops]
    grads = {"x": x.grad, **{n: p.grad.clone() for n, p in fuser.named_parameters()}}
    grads.update({f"extra{i}": e.grad for i, e in enumerate(extra) if e.is_floating_point()})
    return y, grads, names


def compare(a, b, dtype, what):
    ya, ga = a[0], a[1]
    yb, gb = b[0], b[1]
    assert_close(ya, yb, dtype, f"{what} y")
    assert ga.keys() == gb.keys()
    for k in ga:
        assert_close(ga[k], gb[k], dtype, f"{what} grad {k}")


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("act", ["gelu", "relu", None])
def test_linear_bias_activation(recipe_name, act):
    torch.manual_seed(10)
    dtype = torch.float32
    recipe = make_recipe(recipe_name)
    act_ops = {"gelu": [ops.GELU()], "relu": [ops.ReLU()], None: []}[act]
    fuser = ops.OperationFuser([ops.BasicLinear(128, 128), ops.Bias(128), *act_ops])
    with torch.no_grad():
        fuser.basic_ops[1].bias.normal_()
    x = torch.randn(8, 128)
    dy = torch.randn(8, 128)
    fused = run(fuser, x, [], recipe, dy, fused=True)
    unfused = run(fuser, x, [], recipe, dy, fused=False)
    expected_fwd = "ForwardLinearBiasActivation"
    assert fused[2][0] == expected_fwd and expected_fwd not in unfused[2]
    if act:
        assert "BackwardActivationBias" in fused[2]
    compare(fused, unfused, dtype, "fused vs unfused")
    # float64 reference
    x64, w64, b64 = leaf64(x), leaf64(fuser.basic_ops[0].weight), leaf64(fuser.basic_ops[1].bias)
    y64 = ref_linear(x64, w64, recipe, dtype) + b64
    y64 = {"gelu": torch.nn.functional.gelu, "relu": torch.relu, None: lambda t: t}[act](y64)
    y64.backward(dy.double())
    ref = (y64, {"x": x64.grad, "basic_ops.0.weight": w64.grad, "basic_ops.1.bias": b64.grad})
    compare(fused, ref, dtype, "fused vs float64")


def _grouped_mlp(E, H, F, *, scaled, bias, limit=None, dtype=torch.float32):
    act = ops.ScaledSwiGLU(limit=limit) if scaled else ops.SwiGLU(limit=limit)
    fuser = ops.OperationFuser(
        [ops.GroupedLinear(E, H, 2 * F, bias=bias, dtype=dtype), act, ops.GroupedLinear(E, F, H, bias=bias, dtype=dtype)]
    )
    if bias:
        with torch.no_grad():
            fuser.basic_ops[0].bias.normal_()
            fuser.basic_ops[2].bias.normal_()
    return fuser


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "plain"])
def test_grouped_mlp(recipe_name, scaled):
    torch.manual_seed(11)
    dtype = torch.float32
    recipe = make_recipe(recipe_name)
    E, H, F = 3, 128, 128
    fuser = _grouped_mlp(E, H, F, scaled=scaled, bias=True, limit=None if scaled else 2.0)
    splits = torch.tensor([6, 0, 10])
    x = torch.randn(16, H)
    probs = torch.rand(16)
    extra = [splits, probs, splits] if scaled else [splits, splits]
    dy = torch.randn(16, H)
    fused = run(fuser, x, extra, recipe, dy, fused=True)
    unfused = run(fuser, x, extra, recipe, dy, fused=False)
    assert fused[2] == ["GroupedMLP", "GroupedMLP"]
    assert "GroupedMLP" not in unfused[2]
    compare(fused, unfused, dtype, "fused vs unfused")
    # float64 reference
    fc1, act, fc2 = fuser.basic_ops
    x64, p64 = leaf64(x), leaf64(probs)
    w1, b1, w2, b2 = (leaf64(t) for t in (fc1.weight, fc1.bias, fc2.weight, fc2.bias))
    h = ref_grouped_linear(x64, w1, b1, splits, recipe, dtype)
    a = ref_swiglu(h, act.limit)
    if scaled:
        a = a * p64[:, None]
    y64 = ref_grouped_linear(a, w2, b2, splits, recipe, dtype)
    y64.backward(dy.double())
    ref_grads = {"x": x64.grad, "basic_ops.0.weight": w1.grad, "basic_ops.0.bias": b1.grad,
                 "basic_ops.2.weight": w2.grad, "basic_ops.2.bias": b2.grad}
    if scaled:
        ref_grads["extra1"] = p64.grad
    tol_dtype = dtype if recipe is None else torch.bfloat16  # two chained quantized GEMMs: looser
    compare(fused, (y64, ref_grads), tol_dtype, "fused vs float64")


def test_grouped_mlp_bf16_and_shared_offsets():
    torch.manual_seed(12)
    fuser = _grouped_mlp(4, 16, 8, scaled=True, bias=False, dtype=torch.bfloat16)
    splits = torch.tensor([3, 5, 0, 4])
    x = torch.randn(12, 16, dtype=torch.bfloat16)
    probs = torch.rand(12)
    dy = torch.randn(12, 16, dtype=torch.bfloat16)
    # distinct (equal) split-size tensors for the two GEMMs are accepted too
    fused = run(fuser, x, [splits, probs, splits.clone()], None, dy, fused=True)
    unfused = run(fuser, x, [splits, probs, splits], None, dy, fused=False)
    assert fused[2] == ["GroupedMLP", "GroupedMLP"]
    compare(fused, unfused, torch.bfloat16, "bf16 fused vs unfused")


def test_grouped_mlp_all_rows_on_one_expert_and_empty_input():
    torch.manual_seed(13)
    fuser = _grouped_mlp(3, 8, 4, scaled=True, bias=True)
    x = torch.randn(5, 8, requires_grad=True)
    probs = torch.rand(5, requires_grad=True)
    splits = torch.tensor([0, 5, 0])
    y = fuser(x, splits, probs, splits)
    y.sum().backward()
    w1 = fuser.basic_ops[0].weight.grad
    assert torch.count_nonzero(w1[0]) == 0 and torch.count_nonzero(w1[2]) == 0 and torch.count_nonzero(w1[1]) > 0
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    empty = torch.zeros(0, 8, requires_grad=True)
    zero_splits = torch.zeros(3, dtype=torch.int64)
    y0 = fuser(empty, zero_splits, torch.zeros(0, requires_grad=True), zero_splits)
    assert y0.shape == (0, 8)
    y0.sum().backward()


def test_partially_frozen_fusions_match_reference():
    """Forward fusions straddle the backward boundary; gradients of the trainable part stay exact."""
    torch.manual_seed(14)
    lin1, bias, lin2 = ops.BasicLinear(8, 16), ops.Bias(16), ops.BasicLinear(16, 4)
    with torch.no_grad():
        bias.bias.normal_()
    lin1.weight.requires_grad_(False)
    fuser = ops.OperationFuser([lin1, bias, ops.GELU(), lin2])
    x = torch.randn(5, 8)
    fuser(x).sum().backward()
    assert fuser.fusion_key == (None, 1)
    assert type(fuser.plan.forward_ops[0].op).__name__ == "ForwardLinearBiasActivation"
    b64, w2 = leaf64(bias.bias), leaf64(lin2.weight)
    (torch.nn.functional.gelu(x.double() @ lin1.weight.double().t() + b64) @ w2.t()).sum().backward()
    assert_close(bias.bias.grad, b64.grad, torch.float32, "db")
    assert_close(lin2.weight.grad, w2.grad, torch.float32, "dw2")

    mlp = _grouped_mlp(2, 8, 4, scaled=True, bias=True)
    fc1, _, fc2 = mlp.basic_ops
    fc1.weight.requires_grad_(False)
    fc1.bias.requires_grad_(False)
    splits = torch.tensor([3, 2])
    probs = torch.rand(5, requires_grad=True)
    mlp(x, splits, probs, splits).sum().backward()
    assert mlp.fusion_key == (None, 1)
    names = [type(s.op).__name__ for s in mlp.plan.forward_ops], [type(s.op).__name__ for s in mlp.plan.backward_ops]
    assert names == (["GroupedMLP"], ["ScaledSwiGLU", "GroupedLinear"])
    p64, w2_64, b2_64 = leaf64(probs), leaf64(fc2.weight), leaf64(fc2.bias)
    h = ref_grouped_linear(x.double(), fc1.weight.double(), fc1.bias.double(), splits, None, torch.float32)
    ref_grouped_linear(ref_swiglu(h) * p64[:, None], w2_64, b2_64, splits, None, torch.float32).sum().backward()
    assert_close(probs.grad, p64.grad, torch.float32, "dprobs")
    assert_close(fc2.weight.grad, w2_64.grad, torch.float32, "dw2")
    assert_close(fc2.bias.grad, b2_64.grad, torch.float32, "db2")
    assert fc1.weight.grad is None


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_grouped_mlp_hands_host_split_sizes_to_every_gemm(monkeypatch, fused):
    """Split sizes on the host reach all six GEMMs as ``group_sizes`` (the backend may then run
    cuBLAS per expert without reading offsets), fused or not."""
    from te_dist import kernels

    seen = []
    for name in ("grouped_mm_forward", "grouped_mm_dgrad", "grouped_mm_wgrad"):
        original = getattr(kernels, name)

        def recording(*args, _original=original, _name=name, **kw):
            seen.append((_name, kw.get("group_sizes")))
            return _original(*args, **kw)

        monkeypatch.setattr(kernels, name, recording)
    torch.manual_seed(14)
    fuser = _grouped_mlp(3, 8, 4, scaled=True, bias=True)
    splits = torch.tensor([2, 0, 3])
    x = torch.randn(5, 8, requires_grad=True)
    with ops.fusion_rules_scope(disable=() if fused else ALL_RULES):
        fuser(x, splits, torch.rand(5), splits).sum().backward()
    want = ["grouped_mm_forward", "grouped_mm_dgrad", "grouped_mm_wgrad"] * 2
    assert sorted(n for n, _ in seen) == sorted(want)
    assert all(sizes == (2, 0, 3) for _, sizes in seen), seen
