"""Spec helpers: swapping our experts into Megatron's layer/block specs, 0.16 and 0.19 spec styles."""

import functools

import pytest
import torch

import mcore_helpers as H


def _module_of(spec):
    """The class a spec builds: ModuleSpec.module (0.16) or functools.partial.func (0.19)."""
    return spec.func if isinstance(spec, functools.partial) else getattr(spec, "module", spec)


def _experts_of(moe_spec):
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    sub = moe_spec.keywords["submodules"] if isinstance(moe_spec, functools.partial) else moe_spec.submodules
    assert isinstance(sub, MoESubmodules)
    return sub.experts


def test_experts_spec_builds_through_both_release_paths(megatron_world1):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    import te_dist.megatron as tm

    spec = tm.experts_spec(recipe="block")
    assert isinstance(spec, ModuleSpec) and spec.module is tm.GroupedExperts
    config = H.make_config()
    pgs = get_default_pg_collection()
    via_build = build_module(spec, 4, config, pg_collection=pgs)  # how 0.16's MoELayer builds experts
    via_call = spec(4, config, pg_collection=pgs, name="decoder.layers.0.mlp.experts")  # 0.19's call
    for experts in (via_build, via_call):
        assert isinstance(experts, tm.GroupedExperts)
        assert experts.recipe.NAME == "block"
    assert via_call.name == "decoder.layers.0.mlp.experts"
    with pytest.raises(TypeError, match="unknown options"):
        tm.experts_spec(recipe="block", grouped=True)
    with pytest.raises(ValueError, match="unknown"):
        spec_bad = tm.experts_spec(recipe="fp8-ish")
        spec_bad(4, config, pg_collection=pgs)


def test_with_te_dist_experts_swaps_layer_block_and_partial_specs(megatron_world1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    import te_dist.megatron as tm

    layer = get_gpt_layer_local_spec(num_experts=4)
    swapped = tm.with_te_dist_experts(layer, recipe="mxfp8")
    assert _experts_of(swapped.submodules.mlp).module is tm.GroupedExperts
    assert _experts_of(swapped.submodules.mlp).params["recipe"] == "mxfp8"
    assert _module_of(_experts_of(layer.submodules.mlp)) is SequentialMLP  # the input is not mutated

    config = H.make_config(num_layers=3, moe_layer_freq=[0, 1, 1])
    block = tm.gpt_decoder_block_spec(config)
    kinds = [_module_of(s.submodules.mlp) for s in block.layer_specs]
    assert kinds[1] is MoELayer and kinds[2] is MoELayer and kinds[0] is not MoELayer
    assert all(_experts_of(s.submodules.mlp).module is tm.GroupedExperts for s in block.layer_specs[1:])
    untouched = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    assert _module_of(_experts_of(untouched.layer_specs[1].submodules.mlp)) is SequentialMLP

    # 0.19 writes MoE specs as functools.partial(MoELayer, submodules=MoESubmodules(...)).
    partial_spec = functools.partial(MoELayer, submodules=MoESubmodules(experts=SequentialMLP))
    swapped_partial = tm.with_te_dist_experts(partial_spec)
    assert isinstance(swapped_partial, functools.partial)
    assert _experts_of(swapped_partial).module is tm.GroupedExperts
    assert partial_spec.keywords["submodules"].experts is SequentialMLP

    with pytest.raises(ValueError, match="no MoESubmodules"):
        tm.with_te_dist_experts(get_gpt_layer_local_spec(num_experts=None))


def test_layer_specs_module_works_with_megatron_spec_option(megatron_world1):
    """`--spec te_dist.megatron.layer_specs moe_layer_block` resolves through Megatron's import_module."""
    from megatron.core.transformer.spec_utils import import_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    import te_dist.megatron as tm

    spec = import_module(("te_dist.megatron.layer_specs", "moe_layer_block"))
    assert spec.module is TransformerLayer
    assert _experts_of(spec.submodules.mlp).params["recipe"] == "block"
    default = import_module(("te_dist.megatron.layer_specs", "moe_layer"))
    assert _experts_of(default.submodules.mlp).params["recipe"] == tm.RECIPE_FROM_CONFIG


def _build_transformer_layer(spec, config):
    from megatron.core.transformer.spec_utils import build_module

    layer = build_module(spec, config=config, layer_number=1)
    return layer.to(H.device())


def test_transformer_layer_with_our_experts_matches_sequential(megatron_world1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import te_dist.megatron as tm

    config = H.make_config()
    ref = _build_transformer_layer(get_gpt_layer_local_spec(num_experts=4), config)
    ours = _build_transformer_layer(tm.gpt_layer_spec(), config)
    # Same attention, norms and router; experts copied across layouts.
    ours_state = ours.state_dict()
    for key, value in ref.state_dict().items():
        if ".experts." not in key and key in ours_state and value is not None:
            ours_state[key] = value
    ours.load_state_dict(ours_state)
    H.copy_experts_weights(ref.mlp.experts, ours.mlp.experts)

    seq, batch = 5, 2
    x = torch.randn(seq, batch, config.hidden_size, device=H.device())
    mask = torch.triu(torch.ones(batch, 1, seq, seq, dtype=torch.bool, device=H.device()), diagonal=1)
    outs = []
    for layer in (ref, ours):
        xi = x.clone().requires_grad_(True)
        y, _ = layer(xi, attention_mask=mask)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, layer.self_attention.linear_qkv.weight.grad))
    (y_ref, dx_ref, dqkv_ref), (y, dx, dqkv) = outs
    assert y.shape == x.shape
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dqkv, dqkv_ref, rtol=1e-5, atol=1e-5)
    assert ours.mlp.experts.linear_fc1.weight.grad is not None


def test_gpt_model_with_decoder_block_spec_matches_sequential(megatron_world1):
    """A 2-layer GPTModel (dense layer, then MoE layer) built from our block spec: same loss and grads."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    import te_dist.megatron as tm

    config = H.make_config(num_layers=2, moe_layer_freq=[0, 1])
    models = []
    for spec in (get_gpt_decoder_block_spec(config, use_transformer_engine=False), tm.gpt_decoder_block_spec(config)):
        torch.manual_seed(5)
        models.append(GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                               position_embedding_type="rope").to(H.device()))
    ref, ours = models
    state = ours.state_dict()
    state.update({k: v for k, v in ref.state_dict().items() if ".experts." not in k and k in state})
    ours.load_state_dict(state)
    H.copy_experts_weights(ref.decoder.layers[1].mlp.experts, ours.decoder.layers[1].mlp.experts)
    assert isinstance(ours.decoder.layers[1].mlp.experts, tm.GroupedExperts)

    ids = torch.randint(0, 64, (2, 8), device=H.device())
    positions = torch.arange(8, device=H.device()).repeat(2, 1)
    mask = torch.triu(torch.ones(2, 1, 8, 8, dtype=torch.bool, device=H.device()), diagonal=1)
    losses = []
    for model in (ref, ours):
        loss = model(ids, positions, mask, labels=ids)
        loss.mean().backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.embedding.word_embeddings.weight.grad, ref.embedding.word_embeddings.weight.grad,
                               rtol=1e-4, atol=1e-6)
