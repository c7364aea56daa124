"""Checkpoint layout with global expert indices, so a checkpoint moves between EP sizes.

Inside the layer, expert weights are stacked per rank ([El, out, in] in the grouped-linear ops).
In a state_dict they appear per *global* expert:

    <prefix>experts.<g>.fc1.weight  [2F or F, H]     <prefix>experts.<g>.fc1.bias  [2F or F]
    <prefix>experts.<g>.fc2.weight  [H, F]           <prefix>experts.<g>.fc2.bias  [H]

Each rank saves its own experts; the union of all ranks' dicts (``merge_expert_state_dicts``)
is a full checkpoint. Loading picks this rank's experts from any dict that holds them and
silently skips other ranks' experts (they are not "unexpected": they belong to the same layer).
"""

from __future__ import annotations

import re

import torch

__all__ = ["install_expert_state_dict_hooks", "merge_expert_state_dicts"]

_EXPERT_KEY = re.compile(r"experts\.(\d+)\.(.+)$")


def merge_expert_state_dicts(state_dicts) -> dict:
    """Union of per-rank state_dicts; shared (non-expert) entries are taken from the first."""
    merged = {}
    for sd in state_dicts:
        for key, value in sd.items():
            merged.setdefault(key, value)
    return merged


def install_expert_state_dict_hooks(layer, slots: dict, first_expert: int, num_experts: int) -> None:
    """Map stacked parameters to per-global-expert keys on save, and back on load.

    ``slots``: global-key suffix (e.g. ``"fc1.weight"``) → the layer's internal parameter name
    (e.g. ``"mlp.ops.0.weight"``); the parameter's dim 0 is the local expert.
    """
    num_local = dict(layer.named_parameters())[next(iter(slots.values()))].shape[0]

    def save_hook(module, state_dict, prefix, local_metadata):
        for suffix, internal in slots.items():
            stacked = state_dict.pop(prefix + internal)
            for i in range(num_local):
                state_dict[f"{prefix}experts.{first_expert + i}.{suffix}"] = stacked[i]

    def load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        params = dict(module.named_parameters())  # from `module`, not a closure: deepcopy-safe
        for key in list(state_dict):
            if not key.startswith(prefix):
                continue
            match = _EXPERT_KEY.match(key[len(prefix):])
            if match is None:
                continue
            g, suffix = int(match.group(1)), match.group(2)
            if suffix in slots and 0 <= g < num_experts and not first_expert <= g < first_expert + num_local:
                del state_dict[key]  # another EP rank's expert: not ours to load, not unexpected
        for suffix, internal in slots.items():
            keys = [f"{prefix}experts.{first_expert + i}.{suffix}" for i in range(num_local)]
            if prefix + internal in state_dict:
                continue  # an internal-layout dict (e.g. from a raw module copy) loads as is
            present = [k for k in keys if k in state_dict]
            if len(present) != num_local:
                missing_keys.extend(k for k in keys if k not in state_dict)
                for k in present:
                    del state_dict[k]
                state_dict[prefix + internal] = params[internal].detach()  # keep current values
                continue
            parts = [state_dict.pop(k) for k in keys]
            expected = tuple(params[internal].shape[1:])
            bad = [(k, tuple(p.shape)) for k, p in zip(keys, parts) if tuple(p.shape) != expected]
            if bad:
                error_msgs.append(f"expert tensors of the wrong shape (expected {expected}): {bad}")
                state_dict[prefix + internal] = params[internal].detach()
                continue
            state_dict[prefix + internal] = torch.stack([p.to(params[internal].device) for p in parts])

    layer.register_state_dict_post_hook(save_hook)
    layer.register_load_state_dict_pre_hook(load_pre_hook)
