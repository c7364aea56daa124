"""Plain (torch) ``state_dict`` keys of Megatron's expert modules, loaded into ``GroupedExperts``.

Why: Megatron code that works on plain state dicts writes its experts' keys, not ours. Its dense →
MoE upcycling writes SequentialMLP's (or TEGroupedMLP's) per-expert keys, and a conversion script
may hold a state dict saved from either. ``GroupedExperts.load_state_dict`` takes them as well as
its own stacked ones; keys are per *local* expert, as those modules write them on each rank.

    ours [E_local, ...]         SequentialMLP (local expert e)           TEGroupedMLP
    linear_fc1.weight           local_experts.{e}.linear_fc1.weight      linear_fc1.weight{e}
    linear_fc1.bias             local_experts.{e}.linear_fc1.bias        linear_fc1.bias{e}
    linear_fc2.weight           local_experts.{e}.linear_fc2.weight      linear_fc2.weight{e}
    linear_fc2_bias             local_experts.{e}.linear_fc2.bias        linear_fc2.bias{e}

Their ``_extra_state`` entries (empty for the local linears, TransformerEngine's FP8 metadata for
TEGroupedMLP) carry nothing these experts use and are dropped. A state dict holding some but not
all local experts of a tensor is an error that names the missing keys.
"""

from __future__ import annotations

import re

import torch

__all__ = ["install_megatron_layout_loading", "MEGATRON_EXPERT_LAYOUTS"]

# our name -> (SequentialMLP key of local expert {e}, TEGroupedMLP key of local expert {e})
MEGATRON_EXPERT_LAYOUTS = {
    "linear_fc1.weight": ("local_experts.{e}.linear_fc1.weight", "linear_fc1.weight{e}"),
    "linear_fc1.bias": ("local_experts.{e}.linear_fc1.bias", "linear_fc1.bias{e}"),
    "linear_fc2.weight": ("local_experts.{e}.linear_fc2.weight", "linear_fc2.weight{e}"),
    "linear_fc2_bias": ("local_experts.{e}.linear_fc2.bias", "linear_fc2.bias{e}"),
}
_EXTRA_STATE = re.compile(r"(local_experts\.\d+\.)?linear_fc[12]\._extra_state$")


def _stack_layout(state_dict, prefix: str, ours: str, pattern: str, num_local: int, error_msgs: list) -> None:
    keys = [prefix + pattern.format(e=e) for e in range(num_local)]
    present = [k for k in keys if k in state_dict]
    if not present:
        return
    if len(present) != num_local or prefix + ours in state_dict:
        error_msgs.append(
            f"{prefix}{ours}: expected all {num_local} local experts' {pattern!r} keys and no {prefix + ours!r}, "
            f"found {len(present)} of them (missing {[k for k in keys if k not in state_dict]})"
            + (f" and {prefix + ours!r}" if prefix + ours in state_dict else "")
        )
        return
    state_dict[prefix + ours] = torch.stack([state_dict.pop(k) for k in keys])


def install_megatron_layout_loading(experts) -> None:
    """Make ``experts.load_state_dict`` accept SequentialMLP's and TEGroupedMLP's per-expert keys."""

    def load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs):
        names = {name for name, _ in module.named_parameters()}
        for ours, patterns in MEGATRON_EXPERT_LAYOUTS.items():
            if ours not in names:
                continue
            for pattern in patterns:
                _stack_layout(state_dict, prefix, ours, pattern, module.num_local_experts, error_msgs)
        for key in [k for k in state_dict if k.startswith(prefix) and _EXTRA_STATE.match(k[len(prefix):])]:
            del state_dict[key]

    experts.register_load_state_dict_pre_hook(load_pre_hook)
