"""Dense → MoE upcycling into te_dist's experts equals Megatron's own upcycling into SequentialMLP."""

import pytest
import torch
import torch.nn.functional as F

import mcore_helpers as H

SEQ, BATCH, VOCAB = 8, 2, 32


def _gpt(config, experts=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import te_dist.megatron as tm

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
    if experts == "te_dist":
        spec = tm.with_te_dist_experts(spec, recipe="none")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ).to(H.device())


def _logits(model, tokens):
    positions = torch.arange(SEQ, device=tokens.device).unsqueeze(0).expand(BATCH, -1)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=tokens.device), diagonal=1)
    with torch.no_grad():
        return model(tokens, positions, mask)


@pytest.mark.parametrize("overrides", [
    {},  # SwiGLU experts, softmax after top-k
    {"moe_router_pre_softmax": True, "add_bias_linear": True},
    {"gated_linear_unit": False, "activation_func": F.gelu},
])
def test_upcycled_te_dist_model_equals_megatrons_upcycling_into_sequential_mlp(megatron_world1, overrides):
    from megatron.core.transformer.moe import upcycling_utils

    from te_dist.megatron.upcycling import load_and_upcycle_model, upcycle_state_dict

    common = dict(num_layers=2, hidden_size=16, ffn_hidden_size=32, **overrides)
    dense = _gpt(H.make_config(num_moe_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2, **common))
    with torch.no_grad():
        for name, param in dense.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.1)  # biases start at zero: give the conversion something to move
    moe_config = H.make_config(num_moe_experts=4, moe_ffn_hidden_size=16, **common)  # granularity 2, expansion 2
    torch.manual_seed(1)
    sequential = _gpt(moe_config)
    ours = _gpt(moe_config, "te_dist")
    # Upcycling keeps the MoE model's own router (its first granularity slice, repeated), so both
    # models start from SequentialMLP's initial weights (loaded through its per-expert keys).
    ours.load_state_dict(sequential.state_dict(), strict=True)

    with pytest.raises(TypeError, match="not supported by upcycling"):  # what Megatron's own does with ours
        upcycling_utils.upcycle_state_dict([ours], [dense])
    reference = upcycling_utils.upcycle_state_dict([sequential], [dense])["model"]
    sequential.load_state_dict(reference, strict=True)
    # upcycle_state_dict gives the state dict Megatron writes for SequentialMLP (less the local
    # linears' empty _extra_state entries, which it copies from SequentialMLP's own state dict).
    ours_dict = upcycle_state_dict([ours], [dense])["model"]
    assert set(ours_dict) == {k for k in reference if not (".local_experts." in k and k.endswith("_extra_state"))}
    for key, value in ours_dict.items():
        if ".experts." in key or ".router." in key:
            torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=key)
    loaded = []
    assert load_and_upcycle_model(lambda: loaded.append(1) or (7, 0.5), [ours], [dense]) == (7, 0.5)
    assert loaded == [1]
    assert type(ours.decoder.layers[0].mlp.experts).__name__ == "GroupedExperts"  # the model is whole again

    for layer in range(2):
        seq_experts = sequential.decoder.layers[layer].mlp.experts.local_experts
        our_experts = ours.decoder.layers[layer].mlp.experts
        for e, expert in enumerate(seq_experts):
            torch.testing.assert_close(our_experts.linear_fc1.weight[e], expert.linear_fc1.weight, rtol=0, atol=0)
            torch.testing.assert_close(our_experts.linear_fc2.weight[e], expert.linear_fc2.weight, rtol=0, atol=0)
            if expert.linear_fc2.bias is not None:
                torch.testing.assert_close(our_experts.linear_fc2_bias[e], expert.linear_fc2.bias, rtol=0, atol=0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device=H.device())
    y_ref, y = _logits(sequential, tokens), _logits(ours, tokens)
    assert y_ref.abs().sum() > 0
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


def test_state_dict_of_sequential_mlp_loads_into_te_dist_experts(megatron_world1):
    """Plain state dicts interchange too: SequentialMLP's per-expert keys load into our stacked tensors."""
    config = H.make_config(add_bias_linear=True)
    sequential = H.build_moe_layer(config, "sequential")
    with torch.no_grad():
        for param in sequential.parameters():
            param.normal_()
    ours = H.build_moe_layer(config, "te_dist")
    ours.load_state_dict(sequential.state_dict(), strict=True)
    x = torch.randn(6, 2, config.hidden_size, device=H.device())
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], sequential(x)[0], rtol=1e-5, atol=1e-6)

    partial = {k: v for k, v in sequential.state_dict().items() if "local_experts.3." not in k}
    with pytest.raises(RuntimeError, match=r"local_experts\.3\.linear_fc1\.weight"):
        ours.load_state_dict(partial, strict=True)
