"""Distributed-checkpoint layout of grouped expert weights, interchangeable with SequentialMLP.

Why: a Megatron checkpoint written with ``SequentialMLP`` (or TEGroupedMLP, which writes the same
layout) must load into our experts and back, at any expert-parallel size. Our parameters are one
tensor per projection holding all local experts; Megatron's checkpoint keys hold one global tensor
per projection with a leading expert axis. Expert-parallel rank r owns global experts
``r*E_local .. (r+1)*E_local - 1``.

    ours (per rank)                    checkpoint key (global, E = all experts)       SequentialMLP (local_experts.e.)
    linear_fc1.weight [E_local, 2F, H] {prefix}experts.linear_fc1.weight [E, 2F, H]   linear_fc1.weight [2F, H]
    linear_fc1.bias   [E_local, 2F]    {prefix}experts.linear_fc1.bias   [E, 2F]      linear_fc1.bias   [2F]
    linear_fc2.weight [E_local, H, F]  {prefix}experts.linear_fc2.weight [E, H, F]    linear_fc2.weight [H, F]
    linear_fc2_bias   [E_local, H]     {prefix}experts.linear_fc2.bias   [E, H]       linear_fc2.bias   [H]

Rows 0..F-1 of fc1 are the gate (SiLU input), rows F..2F-1 the linear ("up") half, in both.
With a gated fc1 Megatron writes the two halves as separate shards (its SwiGLU factory); we write
the same shards, plus the ``_extra_state`` objects its local linears write, so either side finds
every key it asks for. With ``metadata={"singleton_local_shards": True}`` each global expert g has
keys of its own, ``{prefix}experts.{g}.linear_fc1.weight`` (gated halves ``..._w`` / ``..._v``),
as SequentialMLP writes them then.

Expert tensor parallelism (ETP size P, rank r) shards F as Megatron's column/row-parallel expert
linears do: fc1 rows (and fc1 bias) along axis 0, fc2 columns along axis 1, the fc2 bias replicated.
A gated fc1 holds ``[gate_r; up_r]`` locally: its halves are fragments r and P + r of 2P.
Replica ids follow Megatron's: ``(0, 0, expert-DP rank)`` for TP-sharded tensors,
``(0, r, expert-DP rank)`` for the replicated fc2 bias and the ``_extra_state`` objects.

Megatron's optimizers write their state in this layout by building the factory again for each
state tensor, under their own key (``optimizer.state.exp_avg.`` + ours) and replica id: ``build``
takes both from its arguments, and the ``_extra_state`` objects belong to the model's entry only.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["expert_tensor_factory", "expert_extra_state_objects"]


def expert_key(prefix: str, name: str, global_idx: Optional[int] = None) -> str:
    """``{prefix}experts.{name}``, or ``{prefix}experts.{g}.{name}`` for one expert's singleton keys."""
    return f"{prefix}experts.{name}" if global_idx is None else f"{prefix}experts.{global_idx}.{name}"


def expert_tensor_factory(
    prefix: str,
    name: str,
    data: torch.Tensor,
    *,
    sharded_offsets: tuple,
    ep_rank: int,
    ep_size: int,
    dp_rank: int,
    glu: bool,
    tp_axis: Optional[int] = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    singleton: bool = False,
    extra_state_owner: Optional[str] = None,
):
    """A ShardedTensorFactory writing ``data`` [E_local, ...] as per-expert shards of ``experts.{name}`` [E, ...].

    With ``glu`` the first local axis (2F/P) is written as two half shards, as Megatron's SwiGLU
    factory does. ``tp_axis`` is the axis of one expert's slice that expert tensor parallelism
    shards (fc1: 0, fc2 weight: 1; None: replicated over the ETP group). With ``singleton`` every
    expert gets keys of its own (no expert axis). With ``extra_state_owner`` (``"linear_fc1"``) the
    factory also writes the (empty) per-expert ``_extra_state`` objects of that linear; loading
    ignores them.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if glu and tp_axis != 0:
        raise ValueError(f"{name}: gated halves are split along the tensor-parallel axis 0, got {tp_axis=}")
    num_local = data.shape[0]
    num_global = num_local * ep_size
    expert_axis = len(sharded_offsets)
    replica_id = (0, 0 if tp_axis is not None else tp_rank, dp_rank)
    model_key = expert_key(prefix, name)

    def expert_shards(key_prefix, t_e, global_idx, replica):
        pieces = torch.chunk(t_e, 2, dim=0) if glu else (t_e,)
        if singleton:  # Megatron's singleton SwiGLU halves: separate "_w" / "_v" tensors
            key = expert_key(key_prefix, name, global_idx)
            keys = (f"{key}_w", f"{key}_v") if glu else (key,)
            tp = (expert_axis + tp_axis, tp_rank, tp_size) if tp_axis is not None else (expert_axis, 0, 1)
            return [
                ShardedTensor.from_rank_offsets(
                    k, piece, *sharded_offsets, tp, replica_id=replica, prepend_axis_num=expert_axis,
                )
                for k, piece in zip(keys, pieces)
            ]
        prepend = expert_axis + 1  # the expert axis is prepended to each [..] expert slice
        expert = (expert_axis, global_idx, num_global)
        if glu:  # gate_r is fragment r of 2P, up_r fragment P + r
            return [
                ShardedTensor.from_rank_offsets(
                    expert_key(key_prefix, name), piece, *sharded_offsets, expert,
                    (prepend, half * tp_size + tp_rank, 2 * tp_size), replica_id=replica, prepend_axis_num=prepend,
                )
                for half, piece in enumerate(pieces)
            ]
        tp = ((prepend + tp_axis, tp_rank, tp_size),) if tp_axis is not None and tp_size > 1 else ()
        return [
            ShardedTensor.from_rank_offsets(
                expert_key(key_prefix, name), t_e, *sharded_offsets, expert, *tp,
                replica_id=replica, prepend_axis_num=prepend,
            )
        ]

    @torch.no_grad()
    def build(key, t, replica, flattened_range):
        # Megatron's optimizers build this factory again for each state tensor (``exp_avg`` ...) under
        # their own key ("optimizer.state.exp_avg." + ours) and replica id: take both from the arguments.
        if flattened_range is not None:
            from megatron.core.dist_checkpointing.core import CheckpointingException

            raise CheckpointingException(
                f"{key}: flattened shards (the distributed optimizer's 'fully_sharded_model_space' format) are "
                "not supported by megatron-core >= 0.16 for any tensor; use 'dp_reshardable' or 'fully_reshardable'"
            )
        if not key.endswith(model_key[len(prefix):]):
            raise ValueError(f"factory key {key!r} does not end with {model_key[len(prefix):]!r}")
        key_prefix = key[: len(key) - len(model_key) + len(prefix)]
        built = {"shards": [expert_shards(key_prefix, t[i], ep_rank * num_local + i, replica) for i in range(num_local)]}
        if extra_state_owner is not None and key == model_key:  # the model's own entry, not an optimizer state's
            built["extra_state"] = list(expert_extra_state_objects(
                prefix, extra_state_owner, sharded_offsets=sharded_offsets, ep_rank=ep_rank, num_local=num_local,
                ep_size=ep_size, replica_id=(0, tp_rank, dp_rank), singleton=singleton,
            ).values())
        return built

    def merge(loaded):
        with torch.no_grad():
            return torch.stack([torch.cat(pieces, dim=0) for pieces in loaded["shards"]])

    return ShardedTensorFactory(model_key, data, build, merge, replica_id)


def expert_extra_state_objects(prefix: str, owner: str, *, sharded_offsets: tuple, ep_rank: int, num_local: int,
                               ep_size: int, replica_id: tuple, singleton: bool = False) -> dict:
    """Empty ``_extra_state`` objects at the keys SequentialMLP's local linears use (nothing to restore)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    num_global = num_local * ep_size
    outer = sorted(sharded_offsets, key=lambda o: o[0])  # (axis, offset, count) of enclosing modules
    objects = {}
    for local_idx in range(num_local):
        global_idx = ep_rank * num_local + local_idx
        if singleton:  # Megatron's _get_extra_state_offsets of the enclosing offsets alone
            shape, offset = (tuple(o[2] for o in outer), tuple(o[1] for o in outer)) if outer else ((1,), (0,))
            key = expert_key(prefix, f"{owner}._extra_state", global_idx)
        else:
            shape = (*(o[2] for o in outer), num_global)
            offset = (*(o[1] for o in outer), global_idx)
            key = expert_key(prefix, f"{owner}._extra_state")
        objects[local_idx] = ShardedObject(key, None, shape, offset, replica_id)
    return objects
