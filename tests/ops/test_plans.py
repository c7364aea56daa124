"""Plan structure (which fused op covers which basic ops), plan keys, plan caching and recipe state."""

import pytest
import torch

import te_dist
from te_dist import ops
from te_dist import recipe as R
from te_dist.ops.fuser import MAX_CACHED_PLANS


def structure(plan):
    fwd = [(type(s.op).__name__, s.indices) for s in plan.forward_ops]
    bwd = [(type(s.op).__name__, s.indices) for s in plan.backward_ops]
    return fwd, bwd


def mlp_fuser(E=2, H=32, F=32, scaled=True):
    act = ops.ScaledSwiGLU() if scaled else ops.SwiGLU()
    return ops.OperationFuser([ops.GroupedLinear(E, H, 2 * F), act, ops.GroupedLinear(E, F, H)])


def mlp_call(fuser, grad=True, T=4, H=32):
    x = torch.randn(T, H, requires_grad=grad)
    splits = torch.tensor([T // 2, T - T // 2])
    probs = torch.rand(T)
    n = fuser.basic_ops[0].num_groups
    splits = torch.tensor([T] + [0] * (n - 1)) if n != 2 else splits
    return fuser(x, splits, probs, splits)


# ------------------------------------------------------------------ rule structure
@pytest.mark.parametrize("act_cls", [ops.GELU, ops.ReLU])
def test_linear_bias_activation_structure(act_cls):
    fuser = ops.OperationFuser([ops.BasicLinear(4, 8), ops.Bias(8), act_cls(), ops.BasicLinear(8, 4)])
    fuser(torch.randn(2, 4, requires_grad=True)).sum().backward()
    fwd, bwd = structure(fuser.plan)
    assert fwd == [("ForwardLinearBiasActivation", (0, 1, 2)), ("BasicLinear", (3,))]
    assert bwd == [("BasicLinear", (0,)), ("BackwardActivationBias", (1, 2)), ("BasicLinear", (3,))]
    text = fuser.plan.describe()
    assert "ForwardLinearBiasActivation" in text and "[2] " + act_cls.__name__ in text
    assert "BackwardActivationBias" in text and "first_op_requiring_backward=0" in text


def test_linear_bias_structure_and_no_fusion_for_mismatched_bias():
    fuser = ops.OperationFuser([ops.BasicLinear(4, 8), ops.Bias(8)])
    with torch.no_grad():
        fuser(torch.randn(2, 4))
    assert structure(fuser.plan)[0] == [("ForwardLinearBiasActivation", (0, 1))]
    assert structure(fuser.plan)[1] == []  # no grad: no backward ops
    other = ops.OperationFuser([ops.BasicLinear(4, 8), ops.Bias(6)])
    with pytest.raises(ValueError, match="Bias expects input last dim 6"):
        other(torch.randn(2, 4))  # the rule declined, so the basic Bias reports the mismatch
    assert structure(other.plan)[0] == [("BasicLinear", (0,)), ("Bias", (1,))]


@pytest.mark.parametrize("scaled", [True, False])
def test_grouped_mlp_structure(scaled):
    fuser = mlp_fuser(scaled=scaled)
    if scaled:
        mlp_call(fuser).sum().backward()
    else:
        x = torch.randn(4, 32, requires_grad=True)
        splits = torch.tensor([1, 3])
        fuser(x, splits, splits).sum().backward()
    fwd, bwd = structure(fuser.plan)
    assert fwd == [("GroupedMLP", (0, 1, 2))] and bwd == [("GroupedMLP", (0, 1, 2))]


def test_grouped_mlp_rule_needs_matching_shapes():
    fuser = ops.OperationFuser([ops.GroupedLinear(2, 8, 12), ops.SwiGLU(), ops.GroupedLinear(3, 6, 8)])
    fuser(torch.randn(4, 8), torch.tensor([2, 2]), torch.tensor([1, 1, 2]))
    assert [type(s.op).__name__ for s in fuser.plan.forward_ops] == ["GroupedLinear", "SwiGLU", "GroupedLinear"]


# ------------------------------------------------------------------ keys
def test_first_op_requiring_backward():
    lin1, bias, act, lin2 = ops.BasicLinear(4, 8), ops.Bias(8), ops.GELU(), ops.BasicLinear(8, 4)
    fuser = ops.OperationFuser([lin1, bias, act, lin2])
    x = torch.randn(2, 4)
    fuser(x.requires_grad_(True))
    assert fuser.fusion_key == (None, 0)
    fuser(x.detach())
    assert fuser.fusion_key == (None, 0)  # lin1.weight requires grad
    with torch.no_grad():
        fuser(x)
    assert fuser.fusion_key == (None, 4)
    lin1.weight.requires_grad_(False)
    fuser(x.detach()).sum().backward()
    assert fuser.fusion_key == (None, 1)  # the backward boundary moved to the Bias
    fwd, bwd = structure(fuser.plan)
    # the forward fusion still covers the frozen linear; ops before the boundary have no backward
    assert fwd == [("ForwardLinearBiasActivation", (0, 1, 2)), ("BasicLinear", (3,))]
    assert bwd == [("BackwardActivationBias", (1, 2)), ("BasicLinear", (3,))]
    assert lin1.weight.grad is None and bias.bias.grad is not None
    bias.bias.requires_grad_(False)
    fuser(x.detach()).sum().backward()
    assert fuser.fusion_key == (None, 3)
    assert structure(fuser.plan)[1] == [("BasicLinear", (3,))]
    lin2.weight.requires_grad_(False)
    fuser(x.detach())
    assert fuser.fusion_key == (None, 4)


def test_extra_input_requiring_grad_sets_boundary():
    fuser = mlp_fuser()
    for p in fuser.parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 32)
    splits = torch.tensor([2, 2])
    probs = torch.rand(4, requires_grad=True)
    fuser(x, splits, probs, splits).sum().backward()
    assert fuser.fusion_key == (None, 1)
    assert probs.grad is not None and probs.grad.abs().sum() > 0


def test_train_eval_alternation_builds_each_plan_once():
    fuser = mlp_fuser()
    for _ in range(5):
        mlp_call(fuser).sum().backward()
        with torch.no_grad():
            mlp_call(fuser, grad=False)
    assert fuser.num_plan_builds == 2
    assert set(fuser.cached_plan_keys()) == {(None, 0), (None, 3)}


def test_plan_map_is_bounded():
    fuser = ops.OperationFuser([ops.BasicLinear(4, 4), ops.Bias(4)])
    r = R.Float8CurrentScaling()
    for i in range(MAX_CACHED_PLANS + 5):
        r.custom_index = i  # a public attribute attached at runtime changes the key
        with te_dist.autocast(recipe=r):
            fuser(torch.randn(2, 4))
    assert len(fuser.cached_plan_keys()) == MAX_CACHED_PLANS
    assert fuser.num_plan_builds == MAX_CACHED_PLANS + 5


# ------------------------------------------------------------------ the seed scenario
CHANGES = [
    (R.DelayedScaling, "margin", 1),
    (R.Float8CurrentScaling, "use_power_2_scales", True),
    (R.Float8BlockScaling, "use_power_2_scales", False),
    (R.MXFP8BlockScaling, "margin", 2),
    (R.NVFP4BlockScaling, "disable_rht", True),
]


@pytest.mark.parametrize("recipe_cls, name, value", CHANGES, ids=[c[0].__name__ for c in CHANGES])
def test_same_recipe_object_setting_change(recipe_cls, name, value):
    torch.manual_seed(0)
    fuser = mlp_fuser(E=2, H=128, F=128)
    lin = fuser.basic_ops[0]
    recipe = recipe_cls()
    with te_dist.autocast(recipe=recipe):
        mlp_call(fuser, H=128).sum().backward()
    key1, plan1 = fuser.fusion_key, fuser.plan
    q1 = lin.quantizers.input
    assert key1 == (str(recipe), 0) and q1.settings_key == str(recipe)
    old = getattr(recipe, name)
    setattr(recipe, name, value)  # same object, one setting changed
    with te_dist.autocast(recipe=recipe):
        mlp_call(fuser, H=128).sum().backward()
    key2, plan2 = fuser.fusion_key, fuser.plan
    assert key2 != key1 and key2[0] == str(recipe)
    assert plan2 is not plan1 and fuser.num_plan_builds == 2
    q2 = lin.quantizers.input
    assert q2 is not q1 and q2.settings_key == str(recipe)  # new quantizers for the new settings
    setattr(recipe, name, old)  # revert
    with te_dist.autocast(recipe=recipe):
        mlp_call(fuser, H=128).sum().backward()
    assert fuser.fusion_key == key1 and fuser.plan is plan1  # earlier plan reused
    assert fuser.num_plan_builds == 2
    q3 = lin.quantizers.input
    assert q3 is not q1 and q3 is not q2 and q3.settings_key == key1[0]  # state never reused


def test_recipe_class_change_rebuilds_state():
    fuser = mlp_fuser(E=2, H=128, F=128)
    lin = fuser.basic_ops[2]
    seen = []
    for r in (R.Float8CurrentScaling(), R.MXFP8BlockScaling(), None):
        with te_dist.autocast(recipe=r):
            mlp_call(fuser, H=128).sum().backward()
        seen.append((fuser.fusion_key, lin.quantizers.input))
    assert len({k for k, _ in seen}) == 3
    assert seen[2][1] is None and seen[0][1] is not seen[1][1]
    assert type(seen[0][1]).__name__ != type(seen[1][1]).__name__


def test_attached_attribute_toggles_grouped_mlp_rule():
    fuser = mlp_fuser(E=2, H=128, F=128)
    recipe = R.Float8CurrentScaling()
    with te_dist.autocast(recipe=recipe):
        mlp_call(fuser, H=128).sum().backward()
    plan_enabled, key_enabled = fuser.plan, fuser.fusion_key
    assert structure(plan_enabled)[0] == [("GroupedMLP", (0, 1, 2))]
    recipe.enable_fused_grouped_mlp = False  # a public attribute attached at runtime
    with te_dist.autocast(recipe=recipe):
        mlp_call(fuser, H=128).sum().backward()
    assert fuser.fusion_key != key_enabled and "enable_fused_grouped_mlp" in fuser.fusion_key[0]
    fwd, bwd = structure(fuser.plan)
    assert [n for n, _ in fwd] == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
    assert [n for n, _ in bwd] == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
    recipe.enable_fused_grouped_mlp = True  # explicit True: another key, fused again
    with te_dist.autocast(recipe=recipe):
        mlp_call(fuser, H=128)
    assert structure(fuser.plan)[0] == [("GroupedMLP", (0, 1, 2))]
    del recipe.enable_fused_grouped_mlp  # back to the original settings -> original plan object
    with te_dist.autocast(recipe=recipe):
        mlp_call(fuser, H=128).sum().backward()
    assert fuser.fusion_key == key_enabled and fuser.plan is plan_enabled
    assert fuser.num_plan_builds == 3  # original, False, True


# ------------------------------------------------------------------ rule registries
class _MarkerOp(ops.FusedOperation):
    def fuser_forward(self, ctxs, x, extra_inputs, recipe):
        y, _ = self.basic_ops[0].op_forward(ctxs[0], x, (), recipe)
        y, _ = self.basic_ops[1].op_forward(ctxs[1], y, (), recipe)
        return y * 1, [(), ()]


MARKER_RULE = ops.FusionRule("test_bias_relu", "forward", (ops.Bias, ops.ReLU), lambda o, r: _MarkerOp(o))


def test_rule_scope_does_not_leak():
    fuser = ops.OperationFuser([ops.Bias(4), ops.ReLU()])
    fuser(torch.randn(2, 4))
    assert structure(fuser.plan)[0] == [("Bias", (0,)), ("ReLU", (1,))]
    with ops.fusion_rules_scope(MARKER_RULE):
        assert "test_bias_relu" in ops.OperationFuser.rules.names()
        fuser(torch.randn(2, 4))
        assert structure(fuser.plan)[0] == [("_MarkerOp", (0, 1))]
    assert "test_bias_relu" not in ops.OperationFuser.rules.names()
    fuser(torch.randn(2, 4))
    assert structure(fuser.plan)[0] == [("Bias", (0,)), ("ReLU", (1,))]


def test_subclass_registry_is_separate():
    class MyFuser(ops.OperationFuser):
        pass

    MyFuser.rules.register(MARKER_RULE)
    try:
        assert "test_bias_relu" not in ops.OperationFuser.rules.names()
        mine, base = MyFuser([ops.Bias(4), ops.ReLU()]), ops.OperationFuser([ops.Bias(4), ops.ReLU()])
        mine(torch.randn(2, 4))
        base(torch.randn(2, 4))
        assert structure(mine.plan)[0] == [("_MarkerOp", (0, 1))]
        assert structure(base.plan)[0] == [("Bias", (0,)), ("ReLU", (1,))]
    finally:
        MyFuser.rules.unregister(MARKER_RULE)


def test_disable_rule_in_scope():
    fuser = ops.OperationFuser([ops.BasicLinear(4, 8), ops.Bias(8), ops.GELU()])
    with ops.fusion_rules_scope(disable=("forward_linear_bias_activation",)):
        fuser(torch.randn(2, 4))
        assert structure(fuser.plan)[0] == [("ForwardLinearBiasActivation", (0, 1)), ("GELU", (2,))]
    fuser(torch.randn(2, 4))
    assert structure(fuser.plan)[0] == [("ForwardLinearBiasActivation", (0, 1, 2))]


def test_rule_validation():
    with pytest.raises(ValueError, match="direction"):
        ops.FusionRule("x", "sideways", (ops.Bias,), lambda o, r: None)
    with pytest.raises(ValueError, match="already registered"):
        ops.OperationFuser.rules.register(ops.OperationFuser.rules.for_direction("forward")[0])


# ------------------------------------------------------------------ standalone, errors
def test_standalone_op_and_errors():
    lin = ops.BasicLinear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    y = lin(x)
    torch.testing.assert_close(y, x @ lin.weight.t())
    y.sum().backward()
    assert lin.weight.grad is not None and x.grad is not None
    assert "weight" in dict(lin.named_parameters()) and len(lin.state_dict()) == 1
    with pytest.raises(TypeError, match="expects 1 extra input"):
        ops.GroupedLinear(2, 4, 4)(torch.randn(2, 4))
    with pytest.raises(TypeError, match="BasicOperation"):
        ops.OperationFuser([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="appears twice"):
        ops.OperationFuser([lin, lin])
    with pytest.raises(ValueError, match="empty"):
        ops.OperationFuser([])


def test_second_backward_through_same_call_is_a_clear_error():
    fuser = ops.OperationFuser([ops.BasicLinear(4, 4), ops.GELU()])
    y = fuser(torch.randn(2, 4, requires_grad=True)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        y.backward()
