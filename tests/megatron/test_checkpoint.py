"""Checkpoint layout: our experts' sharded state dict is SequentialMLP's, and checkpoints interchange."""

import pytest
import torch

import mcore_helpers as H


def _flat_shards(sharded_state_dict):
    """{(key, global_offset): (global_shape, local tensor)} of every ShardedTensor after factories."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    apply_factories(sharded_state_dict)
    tensors, objects = {}, set()
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor):
            key = (value.key, tuple(value.global_offset))
            assert key not in tensors, f"duplicate shard {key}"
            tensors[key] = (tuple(value.global_shape), value.data)
        elif isinstance(value, ShardedObject):
            objects.add((value.key, tuple(value.global_shape), tuple(value.global_offset)))
    return tensors, objects


@pytest.mark.parametrize("bias", [False, True])
def test_sharded_layout_equals_sequential_mlp(megatron_world1, bias):
    config = H.make_config(add_bias_linear=bias)
    seq = H.build_moe_layer(config, "sequential")
    ours = H.build_moe_layer(config, "te_dist")
    if bias:
        with torch.no_grad():
            for expert in seq.experts.local_experts:
                expert.linear_fc1.bias.normal_()
                expert.linear_fc2.bias.normal_()
    H.copy_moe_layer(seq, ours)
    # A block-level prefix and an outer (layer) offset, as TransformerBlock passes them.
    offsets = ((0, 2, 3),)
    ref_t, ref_o = _flat_shards(seq.sharded_state_dict(prefix="decoder.layers.mlp.", sharded_offsets=offsets))
    our_t, our_o = _flat_shards(ours.sharded_state_dict(prefix="decoder.layers.mlp.", sharded_offsets=offsets))
    ref_experts = {k: v for k, v in ref_t.items() if ".experts." in k[0]}
    our_experts = {k: v for k, v in our_t.items() if ".experts." in k[0]}
    assert set(our_experts) == set(ref_experts)
    assert len(ref_experts) == (6 if bias else 3) * 4  # per expert: fc1 gate+up halves, fc2 (+ biases)
    for key, (shape, data) in ref_experts.items():
        our_shape, our_data = our_experts[key]
        assert our_shape == shape, key
        torch.testing.assert_close(our_data, data, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    assert {o for o in our_o if ".experts." in o[0]} == {o for o in ref_o if ".experts." in o[0]}


def _save(layer, directory):
    import psutil  # noqa: F401  Megatron's torch_dist writer needs it; without it the save hangs, not fails
    from megatron.core import dist_checkpointing

    directory.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(layer.sharded_state_dict(prefix="mlp."), str(directory))


def _load_into(layer, directory):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(layer.sharded_state_dict(prefix="mlp."), str(directory))
    state = {k[len("mlp."):]: v for k, v in state.items()}
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    assert not unexpected, unexpected


def test_checkpoint_round_trip_with_sequential_mlp(megatron_world1, tmp_path):
    config = H.make_config()
    x = torch.randn(6, 2, config.hidden_size, device=H.device())
    torch.manual_seed(1)
    seq = H.build_moe_layer(config, "sequential")
    torch.manual_seed(2)
    ours = H.build_moe_layer(config, "te_dist")
    with torch.no_grad():
        y_seq = seq(x)[0]
        assert not torch.allclose(ours(x)[0], y_seq)  # different weights before loading

    _save(seq, tmp_path / "from_sequential")
    _load_into(ours, tmp_path / "from_sequential")
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], y_seq, rtol=1e-5, atol=1e-6)

    # And back: perturb ours, save, load into a fresh SequentialMLP.
    with torch.no_grad():
        ours.experts.linear_fc1.weight.mul_(1.5)
        ours.experts.linear_fc2.weight.add_(0.01)
        y_ours = ours(x)[0]
    _save(ours, tmp_path / "from_te_dist")
    torch.manual_seed(3)
    seq2 = H.build_moe_layer(config, "sequential")
    _load_into(seq2, tmp_path / "from_te_dist")
    with torch.no_grad():
        torch.testing.assert_close(seq2(x)[0], y_ours, rtol=1e-5, atol=1e-6)
