"""MoELayer on one process: against a loop reference, gradients, unused experts, errors, checkpoints."""

import functools

import pytest
import torch

import te_dist as td
from reference_moe import expert_weights, reference_moe


close = functools.partial(torch.testing.assert_close, rtol=2e-5, atol=2e-5)


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    opts = dict(bias=True, dtype=torch.float32)
    opts.update(kw)
    return td.moe.MoELayer(8, 6, 4, 2, **opts)


def _x(T=9, seed=1, dtype=torch.float32):
    return torch.randn(T, 8, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("probs_position,activation", [("expert", "swiglu"), ("combine", "swiglu"), ("combine", "gelu")])
def test_forward_and_gradients_match_loop_reference(probs_position, activation):
    layer = _layer(probs_position=probs_position, activation=activation)
    x = _x().requires_grad_(True)
    y = layer(x)
    experts = expert_weights(layer)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = reference_moe(x_ref, layer.router.weight, experts, 2, probs_position=probs_position, activation=activation)
    close(y, ref)
    g = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(2))
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad(y, params, g)
    ref_inputs = [x_ref, layer.router.weight] + [experts[e][n] for e in range(4) for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
    ref_grads = dict(zip(map(id, ref_inputs), torch.autograd.grad(ref, ref_inputs, g, allow_unused=True)))
    close(grads[0], ref_grads[id(x_ref)])
    close(grads[1], ref_grads[id(layer.router.weight)])
    # stacked expert grads vs the per-expert reference (views of the same parameters)
    for op, prefix, off in ((layer.fc1, "fc1", 2), (layer.fc2, "fc2", 4)):
        gw, gb = grads[off], grads[off + 1]
        for e in range(4):
            rw = ref_grads[id(experts[e][f"{prefix}.weight"])]
            rb = ref_grads[id(experts[e][f"{prefix}.bias"])]
            close(gw[e], torch.zeros_like(gw[e]) if rw is None else rw)
            close(gb[e], torch.zeros_like(gb[e]) if rb is None else rb)


def test_all_tokens_to_one_expert_gives_zero_grads_elsewhere():
    torch.manual_seed(0)
    layer = td.moe.MoELayer(8, 6, 4, 1, bias=True, dtype=torch.float32)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2] = 1.0
    x = _x().abs()  # positive rows: expert 2 has the largest logit for every token
    y = layer(x)
    assert layer.tokens_per_expert.tolist() == [0, 0, 9, 0]
    y.square().sum().backward()
    for op in (layer.fc1, layer.fc2):
        for e in (0, 1, 3):
            assert torch.count_nonzero(op.weight.grad[e]) == 0 and torch.count_nonzero(op.bias.grad[e]) == 0
            assert torch.isfinite(op.weight.grad).all()
        assert op.weight.grad[2].abs().sum() > 0


def test_empty_input_and_leading_dims():
    layer = _layer()
    x = torch.zeros(0, 8, dtype=torch.float32, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 8)
    assert torch.count_nonzero(layer.fc1.weight.grad) == 0
    x3 = _x(T=6).view(2, 3, 8)
    torch.testing.assert_close(layer(x3), layer(x3.reshape(6, 8)).view(2, 3, 8))


def test_aux_loss_trains_router():
    x = _x()
    base = _layer()
    with_aux = _layer(aux_loss_coeff=0.5, z_loss_coeff=0.1)
    base(x).sum().backward()
    y = with_aux(x)
    torch.testing.assert_close(y, base(x))  # losses do not change the output
    y.sum().backward()
    assert with_aux.aux_loss is not None and with_aux.z_loss is not None
    assert not torch.allclose(with_aux.router.weight.grad, base.router.weight.grad)


def test_errors_are_clear():
    layer = _layer()
    with pytest.raises(ValueError, match=r"hidden states \[\.\.\., 8\]"):
        layer(torch.zeros(3, 7, dtype=torch.float32))
    with pytest.raises(TypeError, match="dtype"):
        layer(torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype"):
        td.moe.MoELayer(8, 6, 4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="top_k=5 is larger than num_experts=4"):
        td.moe.MoELayer(8, 6, 4, 5)
    with pytest.raises(ValueError, match="activation"):
        td.moe.MoELayer(8, 6, 4, 2, activation="tanh")
    with pytest.raises(ValueError, match="probs_position='expert' needs"):
        td.moe.MoELayer(8, 6, 4, 2, activation="gelu", probs_position="expert")
    x = _x()
    x[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        layer(x)
    x = _x()
    x[2, :] = 0.0
    x[2, 5] = float("inf")  # +-inf logits, no NaN
    with pytest.raises(td.moe.RoutingError, match="NaN or inf on EP rank"):
        layer(x)


def test_same_seed_same_weights_and_state_dict_round_trip():
    a, b = _layer(seed=5), _layer(seed=5)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    c = _layer(seed=6)
    x = _x()
    assert not torch.allclose(c(x), a(x))
    c.load_state_dict(a.state_dict())
    torch.testing.assert_close(c(x), a(x), rtol=0, atol=0)
    keys = list(a.state_dict())
    assert "experts.3.fc2.bias" in keys and not any("basic_ops" in k for k in keys)


def test_state_dict_missing_and_foreign_experts():
    a = _layer()
    sd = a.state_dict()
    del sd["experts.1.fc1.weight"]
    with pytest.raises(RuntimeError, match=r"experts\.1\.fc1\.weight"):
        _layer().load_state_dict(sd)
    sd = a.state_dict()
    sd["experts.7.fc1.weight"] = sd["experts.0.fc1.weight"]  # beyond num_experts: unexpected
    with pytest.raises(RuntimeError, match=r"experts\.7\.fc1\.weight"):
        _layer().load_state_dict(sd)


def test_experts_run_through_fused_grouped_mlp_plan_keyed_by_recipe():
    layer = _layer()
    x = _x().requires_grad_(True)
    layer(x).sum().backward()
    plan = layer.mlp.plan
    assert [type(step.op).__name__ for step in plan.forward_ops] == ["GroupedMLP"]
    assert layer.mlp.fusion_key == (None, 0)
    recipe = td.recipe.recipe_from_name("current")
    with td.autocast(recipe=recipe):
        y = layer(x)
    assert layer.mlp.fusion_key == (str(recipe), 0)
    assert torch.isfinite(y).all() and not torch.equal(y, layer(x))  # quantized numerics differ


def _record_group_sizes(monkeypatch) -> list:
    """The ``group_sizes`` every grouped-GEMM forward is given from now on (appended to the returned list)."""
    from te_dist import kernels

    seen = []
    original = kernels.grouped_mm_forward

    def recording(*args, **kw):
        seen.append(kw.get("group_sizes"))
        return original(*args, **kw)

    monkeypatch.setattr(kernels, "grouped_mm_forward", recording)
    return seen


def test_experts_get_the_host_split_sizes_of_the_count_exchange(monkeypatch):
    seen = _record_group_sizes(monkeypatch)
    layer = _layer()
    layer(_x(T=11))
    want = tuple(layer.tokens_per_local_expert.tolist())
    assert sum(want) == 11 * 2
    assert seen == [want, want]


@pytest.mark.parametrize("total_rows", [False, True], ids=["groups", "groups+total"])
@pytest.mark.parametrize("probs_position", ["expert", "combine"])
@pytest.mark.parametrize("where", ["dispatcher", "layer"])
def test_expert_rows_padded_for_the_native_path_give_the_same_layer(monkeypatch, probs_position, where, total_rows):
    """Rows padded to a multiple (what the native FP8 path needs on a GPU, forced here): the dispatcher
    folds the padding into its expand gather, or, for a transport that does not, the layer pads on
    its own. The GEMMs see padded groups; outputs and every gradient match the unpadded layer
    (biases included: the padding rows' output gradients must be zero). With pad_expert_total_rows the
    last expert also takes the rows that round the total up to 128."""
    x = _x(T=11).requires_grad_(True)
    g = torch.randn(11, 8, generator=torch.Generator().manual_seed(3))
    plain = _layer(probs_position=probs_position)
    y_ref = plain(x)
    ref = torch.autograd.grad(y_ref, [x, *plain.parameters()], g)

    layer = _layer(probs_position=probs_position)
    monkeypatch.setattr(layer, "_native_row_alignment", lambda x_TH, recipe: 8)
    if where == "layer":  # a transport that hands out unpadded rows
        dispatch = layer.dispatcher.dispatch
        monkeypatch.setattr(layer.dispatcher, "dispatch", lambda *a, row_alignment=None, **kw: dispatch(*a, **kw))
    seen = _record_group_sizes(monkeypatch)
    with td.settings.override(pad_expert_total_rows=total_rows):
        y = layer(x)
    received = layer.tokens_per_local_expert.tolist()
    want = [-(-n // 8) * 8 for n in received]
    if total_rows:
        want[-1] += -sum(want) % 128
    assert seen and all(s == tuple(want) for s in seen), (seen, received)
    assert sum(seen[0]) > 22 and (sum(seen[0]) == 128 or not total_rows)  # 11 tokens x top-2 rows, padded
    close(y, y_ref)
    for got, want in zip(torch.autograd.grad(y, [x, *layer.parameters()], g), ref):
        close(got, want)
