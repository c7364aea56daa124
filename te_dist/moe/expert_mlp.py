"""The expert MLP of every local expert as one fused op sequence (MoELayer and the Megatron experts).

    x_NH --GroupedLinear(El, H, 2F | F)--> h --activation--> a_NF --GroupedLinear(El, F, H)--> y_NH

The activation is ``ScaledSwiGLU`` when the routing probability is applied inside the expert
(between the activation and fc2, as Megatron-Core does), else ``SwiGLU``, ``GELU`` or ``ReLU``.
The ops draw their default init from the global generator, an amount that depends on El, so they
are built under a forked generator: the caller's later draws are expert-parallel invariant, and
the values are set by te_dist.moe.init afterwards.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ops import GELU, GroupedLinear, OperationFuser, ReLU, ScaledSwiGLU, SwiGLU

__all__ = ["ACTIVATIONS", "build_expert_mlp"]

ACTIVATIONS = ("swiglu", "gelu", "relu")


def build_expert_mlp(num_local_experts: int, hidden_size: int, ffn_hidden_size: int, *, activation: str = "swiglu",
                     probs_in_expert: bool = True, fc1_bias: bool = False, fc2_bias: bool = False,
                     swiglu_limit: Optional[float] = None, dtype=None, device=None) -> OperationFuser:
    """``OperationFuser([fc1, activation, fc2])``; call it ``fuser(x, splits, probs, splits)`` with
    ``probs_in_expert``, else ``fuser(x, splits, splits)``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    gated = activation == "swiglu"
    if probs_in_expert and not gated:
        raise ValueError(f"a probability applied in the expert needs activation='swiglu' (a scaled op), got {activation!r}")
    if swiglu_limit is not None and not gated:
        raise ValueError(f"swiglu_limit applies to activation='swiglu', got {activation!r}")
    El, H, F = num_local_experts, hidden_size, ffn_hidden_size
    fork_devices = [torch.device(device)] if device is not None and torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        fc1 = GroupedLinear(El, H, 2 * F if gated else F, bias=fc1_bias, dtype=dtype, device=device)
        fc2 = GroupedLinear(El, F, H, bias=fc2_bias, dtype=dtype, device=device)
    if probs_in_expert:
        act = ScaledSwiGLU(limit=swiglu_limit)
    elif gated:
        act = SwiGLU(limit=swiglu_limit)
    else:
        act = GELU() if activation == "gelu" else ReLU()
    return OperationFuser([fc1, act, fc2])
