"""te_dist GroupedExperts inside Megatron's MoELayer vs Megatron's own SequentialMLP (world size 1)."""

import pytest
import torch
import torch.nn.functional as F

import mcore_helpers as H


def _pair(config, **experts_options):
    """(SequentialMLP layer, te_dist layer) with identical router and expert weights."""
    seq = H.build_moe_layer(config, "sequential")
    ours = H.build_moe_layer(config, "te_dist", **experts_options)
    H.copy_moe_layer(seq, ours)
    return seq, ours


def _fwd_bwd(layer, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y, bias = layer(x)
    assert bias is None
    y.backward(dy)
    return y.detach(), x.grad


def test_moe_layer_matches_sequential_mlp(megatron_world1):
    config = H.make_config()
    seq, ours = _pair(config)
    x = torch.randn(6, 2, config.hidden_size, device=H.device())
    dy = torch.randn_like(x)
    y_ref, dx_ref = _fwd_bwd(seq, x, dy)
    y, dx = _fwd_bwd(ours, x, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6)
    # Weight and router gradients agree too (router grads flow through the probabilities).
    torch.testing.assert_close(ours.router.weight.grad, seq.router.weight.grad, rtol=1e-5, atol=1e-6)
    for e, expert in enumerate(seq.experts.local_experts):
        torch.testing.assert_close(ours.experts.linear_fc1.weight.grad[e], expert.linear_fc1.weight.grad,
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.experts.linear_fc2.weight.grad[e], expert.linear_fc2.weight.grad,
                                   rtol=1e-5, atol=1e-6)


def test_experts_module_zero_token_experts_and_cpu_or_device_counts(megatron_world1):
    config = H.make_config(num_moe_experts=4)
    seq, ours = _pair(config)
    tokens_per_expert = torch.tensor([3, 0, 5, 0])
    x = torch.randn(8, config.hidden_size, device=H.device())
    probs = torch.rand(8, device=H.device())
    y_ref, _ = seq.experts(x, tokens_per_expert, probs)
    for counts in (tokens_per_expert, tokens_per_expert.to(torch.int32)):
        y, bias = ours.experts(x, counts, probs)
        assert bias is None
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    x.requires_grad_(True)
    ours.experts(x, tokens_per_expert, probs)[0].sum().backward()
    assert torch.all(ours.experts.linear_fc1.weight.grad[1] == 0)  # expert 1 got no tokens
    assert torch.all(ours.experts.linear_fc2.weight.grad[3] == 0)
    assert ours.experts.linear_fc1.weight.grad[0].abs().sum() > 0


def test_expert_bias_is_scaled_by_probs_like_sequential_mlp(megatron_world1):
    config = H.make_config(add_bias_linear=True)
    seq, ours = _pair(config)
    with torch.no_grad():
        for expert in seq.experts.local_experts:
            expert.linear_fc1.bias.normal_()
            expert.linear_fc2.bias.normal_()
    H.copy_experts_weights(seq.experts, ours.experts)
    counts = torch.tensor([2, 3, 0, 1])
    x = torch.randn(6, config.hidden_size, device=H.device())
    probs = torch.rand(6, device=H.device())
    with torch.no_grad():  # Megatron 0.16's local MLP cannot backprop with bias + probs (in-place on a view)
        y_ref, _ = seq.experts(x, counts, probs)
    y, _ = ours.experts(x, counts, probs)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)

    # Gradients against a per-expert autograd reference of the same function.
    w1 = ours.experts.linear_fc1.weight.detach().clone().requires_grad_(True)
    b1 = ours.experts.linear_fc1.bias.detach().clone().requires_grad_(True)
    w2 = ours.experts.linear_fc2.weight.detach().clone().requires_grad_(True)
    b2 = ours.experts.linear_fc2_bias.detach().clone().requires_grad_(True)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        h = x[start:start + n] @ w1[e].t() + b1[e]
        gate, up = h.chunk(2, dim=-1)
        p = probs[start:start + n, None]
        outs.append((F.silu(gate) * up * p) @ w2[e].t() + p * b2[e])
        start += n
    torch.cat(outs).sum().backward()
    y.sum().backward()
    torch.testing.assert_close(ours.experts.linear_fc1.bias.grad, b1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.experts.linear_fc2_bias.grad, b2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.experts.linear_fc1.weight.grad, w1.grad, rtol=1e-5, atol=1e-6)


def test_probs_on_input_and_clamped_swiglu_match_sequential(megatron_world1):
    for overrides in ({"moe_apply_probs_on_input": True, "moe_router_topk": 1, "moe_router_pre_softmax": True},
                      {"activation_func_clamp_value": 0.5}):
        config = H.make_config(**overrides)
        seq, ours = _pair(config)
        x = torch.randn(5, 1, config.hidden_size, device=H.device()) * 3
        dy = torch.randn_like(x)
        y_ref, dx_ref = _fwd_bwd(seq, x, dy)
        y, dx = _fwd_bwd(ours, x, dy)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{overrides}: {m}")
        torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{overrides}: {m}")


@pytest.mark.parametrize("overrides", [
    {"moe_router_dtype": "fp64"},  # the router, dispatcher and so the experts' probabilities are float64
    {"gated_linear_unit": False, "activation_func": F.gelu},  # Megatron's default experts
    {"gated_linear_unit": False, "activation_func": F.relu},
    {"gated_linear_unit": False, "activation_func": F.gelu, "moe_router_dtype": "fp64"},
    {"activation_func": F.gelu},  # GeGLU: gated with Megatron's default activation
    {"glu_linear_offset": 1.0, "activation_func_clamp_value": 0.5},
])
def test_router_dtypes_and_non_gated_experts_match_sequential(megatron_world1, overrides):
    config = H.make_config(**overrides)
    seq, ours = _pair(config)
    x = torch.randn(8, 2, config.hidden_size, device=H.device())
    dy = torch.randn_like(x)
    y_ref, dx_ref = _fwd_bwd(seq, x, dy)
    y, dx = _fwd_bwd(ours, x, dy)
    assert y.dtype == config.params_dtype  # the expert math stays in the parameters' dtype
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.router.weight.grad, seq.router.weight.grad, rtol=1e-5, atol=1e-6)
    assert ours.experts.linear_fc1.weight.shape[1] == (2 if config.gated_linear_unit else 1) * 8
    assert (ours.experts._fuser is None) == (overrides.get("activation_func", F.silu) is not F.silu
                                             or "glu_linear_offset" in overrides)  # SwiGLU stays fused


def test_integer_probs_are_refused(megatron_world1):
    ours = H.build_moe_layer(H.make_config(), "te_dist")
    x = torch.randn(4, 16, device=H.device())
    with pytest.raises(TypeError, match="floating-point"):
        ours.experts(x, torch.tensor([4, 0, 0, 0]), torch.ones(4, dtype=torch.int64, device=H.device()))


def test_expert_params_are_marked_and_named(megatron_world1):
    config = H.make_config(add_bias_linear=True)
    ours = H.build_moe_layer(config, "te_dist")
    names = {name for name, _ in ours.experts.named_parameters()}
    assert names == {"linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2_bias"}
    # Megatron's marking: at EP = 1 expert parameters are ordinary (allreduce True), as SequentialMLP's
    # (the EP=2 worker checks False); the same optimizer groups follow.
    sequential = H.build_moe_layer(config, "sequential")
    assert {p.allreduce for p in sequential.experts.parameters()} == {True}
    assert all(p.allreduce is True for p in ours.experts.parameters())
    assert ours.experts.linear_fc1.weight.shape == (4, 2 * config.moe_ffn_hidden_size, config.hidden_size)
    assert ours.experts.linear_fc2.weight.shape == (4, config.hidden_size, config.moe_ffn_hidden_size)


def test_init_is_expert_parallel_invariant(megatron_world1):
    """Global expert g draws the same weights whatever rank holds it (same seed)."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from te_dist.megatron import GroupedExperts

    config = H.make_config()
    torch.manual_seed(7)
    a = GroupedExperts(4, config, get_default_pg_collection())
    torch.manual_seed(7)
    b = GroupedExperts(4, config, get_default_pg_collection())
    torch.testing.assert_close(a.linear_fc1.weight, b.linear_fc1.weight, rtol=0, atol=0)
    assert not torch.equal(a.linear_fc1.weight[0], a.linear_fc1.weight[1])
    # Megatron's init_method (normal, std=init_method_std) is what fills the weights.
    assert abs(a.linear_fc1.weight.std().item() - config.init_method_std) < 0.01


@pytest.mark.parametrize("overrides, match", [
    ({"delay_wgrad_compute": True}, "delay_wgrad_compute"),
    ({"moe_latent_size": 4}, "moe_latent_size"),
    ({"activation_func": "silu"}, "callable"),
])
def test_unsupported_configs_raise_before_building(megatron_world1, overrides, match):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from te_dist.megatron import GroupedExperts

    config = H.make_config()
    for name, value in overrides.items():  # set after construction: TransformerConfig checks some itself
        setattr(config, name, value)
    with pytest.raises((ValueError, TypeError), match=match):
        GroupedExperts(4, config, get_default_pg_collection())


def test_bad_inputs_raise_clear_errors(megatron_world1):
    config = H.make_config()
    ours = H.build_moe_layer(config, "te_dist")
    x = torch.randn(6, config.hidden_size, device=H.device())
    probs = torch.rand(6, device=H.device())
    with pytest.raises(ValueError, match="sums to 5"):
        ours.experts(x, torch.tensor([1, 1, 1, 2]), probs)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        ours.experts(x, torch.tensor([3, 3]), probs)
    with pytest.raises(ValueError, match="permuted_probs"):
        ours.experts(x, torch.tensor([3, 3, 0, 0]), probs[:5])
    with pytest.raises(TypeError, match="output_buffer"):
        ours.experts(x, torch.tensor([3, 3, 0, 0]), probs, output_buffer=torch.empty_like(x))
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from te_dist.megatron import GroupedExperts

    with pytest.raises(ValueError, match="num_moe_experts"):
        GroupedExperts(3, config, get_default_pg_collection())


def test_recipe_reaches_the_fuser_and_quantizes(megatron_world1):
    import te_dist.recipe as R

    config = H.make_config()
    seq, ours = _pair(config, recipe="current")
    x = torch.randn(6, 2, config.hidden_size, device=H.device())
    with torch.no_grad():
        y_ref, _ = seq(x)
        y, _ = ours(x)
    assert ours.experts.recipe == R.Float8CurrentScaling()
    assert ours.experts._fuser.fusion_key[0] == str(R.Float8CurrentScaling())
    assert not torch.equal(y, y_ref)  # FP8 really ran
    torch.testing.assert_close(y, y_ref, rtol=0.2, atol=0.05)

    # "none" overrides an outer te_dist.autocast; "config" without fp8 fields inherits it.
    import te_dist

    _, plain = _pair(config, recipe="none")
    _, inherit = _pair(config)
    with te_dist.autocast(recipe=R.Float8CurrentScaling()):
        plain(x)
        inherit(x)
    assert plain.experts._fuser.fusion_key[0] is None
    assert inherit.experts._fuser.fusion_key[0] == str(R.Float8CurrentScaling())


def test_recipe_from_config_fields(megatron_world1):
    import te_dist.recipe as R

    config = H.make_config()
    # Megatron refuses fp8 + MoE at construction without TransformerEngine, so set the fields after.
    config.fp8, config.fp8_recipe = "e4m3", "blockwise"
    ours = H.build_moe_layer(config, "te_dist")
    assert ours.experts.recipe == R.Float8BlockScaling(fp8_format=R.Format.E4M3)


@pytest.mark.parametrize("gated", [True, False])
def test_rows_padded_for_the_native_path_give_the_unpadded_result(megatron_world1, monkeypatch, gated):
    """With ``settings.megatron_row_padding`` on and a recipe whose native path needs a row multiple
    (faked here: on CPU no native path runs), every expert's rows reach the grouped GEMMs padded to
    that multiple, and output and gradients equal the unpadded run's; with the switch off nothing is padded."""
    import te_dist
    import te_dist.megatron.experts as E

    overrides = {} if gated else {"gated_linear_unit": False, "activation_func": F.gelu}
    _, ours = _pair(H.make_config(add_bias_linear=True, **overrides))
    experts = ours.experts
    with torch.no_grad():
        experts.linear_fc1.bias.normal_()
        experts.linear_fc2_bias.normal_()
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, experts.config.hidden_size, device=H.device())
    probs = torch.rand(9, device=H.device())

    def run():
        experts.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        y, _ = experts(xr, counts, probs)
        y.square().sum().backward()
        return [y.detach(), xr.grad] + [p.grad.clone() for p in experts.parameters()]

    with te_dist.settings.override(megatron_row_padding=False):
        reference = run()
    padded_sizes = []
    real_pad = E.pad_expert_rows

    def spy(x_TH, probs_T, sizes, alignment):
        got = real_pad(x_TH, probs_T, sizes, alignment)
        padded_sizes.append(tuple(got.splits.sizes))
        return got

    monkeypatch.setattr(E, "pad_expert_rows", spy)
    monkeypatch.setattr(type(experts), "_native_row_alignment", lambda self, x_TH: 4)
    with te_dist.settings.override(megatron_row_padding=False):
        assert all(torch.equal(a, b) for a, b in zip(run(), reference)) and not padded_sizes  # off: unpadded
    padded = run()  # on by default
    assert padded_sizes == [(4, 0, 8, 116)]  # each expert to 4 rows, the last one the total to 128 rows
    for got, want in zip(padded, reference):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
