"""Distributed checkpoints (torch.distributed.checkpoint) that reload at any EP size.

Why one key per global expert: a rank holding experts [k*E_local, (k+1)*E_local) writes
``model/<param>/expert<e>`` for each of them; a rank of a job with another EP size simply asks
for the experts it now owns. Dense tensors are written under the same key by every rank and
DCP keeps one copy. Optimizer state (AdamW ``exp_avg``, ``exp_avg_sq``, ``step``) follows the
same keys, so a resumed run continues bit-exactly on CPU.

    <out>/checkpoints/step_000020/   DCP shards (.distcp) + .metadata
                                     meta.json  (written last by rank 0: marks the checkpoint complete)
"""

from __future__ import annotations

import json
from pathlib import Path
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..autocast import autocast
from . import recipe_state
from .config import ConfigError
from .parallel import Runtime, dense_group, expert_parameter_names, global_expert_ids

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "checkpoint_dir", "read_meta", "check_compatible"]

_META = "meta.json"
_OPT_KEYS = ("exp_avg", "exp_avg_sq")


def checkpoint_dir(out_dir, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step:06d}"


def read_meta(path) -> dict:
    return json.loads((Path(path) / _META).read_text())


def find_checkpoint(path) -> Path:
    """The newest complete checkpoint under ``path`` (a step dir, a ``checkpoints`` dir or an out dir)."""
    path = Path(path)
    if (path / _META).is_file():
        return path
    for root in (path / "checkpoints", path):
        steps = sorted(p for p in root.glob("step_*") if (p / _META).is_file()) if root.is_dir() else []
        if steps:
            return steps[-1]
    raise ConfigError(f"--resume {path}: no complete checkpoint (a step_* directory with {_META}) found there")


def _state_for(model: nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime, *, for_load: bool) -> tuple:
    """(state dict of tensors to save or fill, bindings: (live tensor, key, local expert index or None)).

    For a load, missing AdamW state is created first so the checkpoint's values have a home.
    """
    experts = set(expert_parameter_names(model))
    state, bindings = {}, []
    for name, p in model.named_parameters():
        opt_state = optimizer.state.get(p, {})
        if for_load and not opt_state:
            opt_state = optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        fields = {"param": p.detach()} | {k: opt_state[k] for k in _OPT_KEYS if k in opt_state}
        if "step" in opt_state:
            state[f"optim/{name}/step"] = opt_state["step"].detach().clone()
            bindings.append((opt_state["step"], f"optim/{name}/step", None))
        if name in experts:
            ids = global_expert_ids(p.shape[0], runtime.ep_rank)
            for field, tensor in fields.items():
                prefix = "model" if field == "param" else f"optim/{field}"
                for local, e in enumerate(ids):
                    key = f"{prefix}/{name}/expert{e}"
                    state[key] = tensor[local].detach().clone()
                    bindings.append((tensor, key, local))
        else:
            for field, tensor in fields.items():
                key = f"model/{name}" if field == "param" else f"optim/{field}/{name}"
                state[key] = tensor.detach().clone()
                bindings.append((tensor, key, None))
    return state, bindings


_SHAPE_KEYS = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads", "num_experts",
               "activation", "expert_bias", "dtype")


def check_compatible(path, model_config: dict) -> dict:
    """The checkpoint's meta, after checking it was written for the same model shape (EP may differ)."""
    meta = read_meta(path)
    saved = meta.get("model", {})
    diff = {k: (saved.get(k), model_config.get(k)) for k in _SHAPE_KEYS if saved.get(k) != model_config.get(k)}
    if diff:
        text = ", ".join(f"model.{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
        raise ConfigError(f"checkpoint {path} was written for another model shape ({text})")
    return meta


def save_checkpoint(path, *, model, optimizer, runtime: Runtime, step: int, meta: dict) -> Path:
    """Collective: every rank writes its share; rank 0 then writes ``meta.json``."""
    path = Path(path)
    state, _ = _state_for(model, optimizer, runtime, for_load=False)
    state[f"rng/cpu/rank{runtime.rank}"] = torch.get_rng_state()
    if runtime.device.type == "cuda":
        state[f"rng/cuda/rank{runtime.rank}"] = torch.cuda.get_rng_state(runtime.device)
    state.update(recipe_state.state_dict(model, f"recipe/rank{runtime.rank}"))
    dcp.save(state, checkpoint_id=str(path))
    dist.barrier()
    if runtime.is_main:
        full = dict(meta, step=step, world_size=runtime.world_size, ep=runtime.ep_size)
        tmp = path / (_META + ".tmp")
        tmp.write_text(json.dumps(full, indent=1, sort_keys=True))
        tmp.replace(path / _META)  # atomic: a checkpoint without meta.json is never picked
    dist.barrier()
    return path


def load_checkpoint(path, *, model, optimizer, runtime: Runtime, model_config: dict, recipe=None,
                    recipe_key=None) -> dict:
    """Fill ``model`` and ``optimizer`` from ``path`` (collective); returns its meta dict.

    The model shape must match the checkpoint's; the EP size and the number of ranks may differ.
    Per-rank RNG states are restored only when the number of ranks is unchanged, recipe state
    (amax histories) only when the ranks, the EP size and the recipe key are unchanged;
    ``meta["restored_recipe_state"]`` says which happened.
    """
    path = Path(path)
    meta = check_compatible(path, model_config)
    state, bindings = _state_for(model, optimizer, runtime, for_load=True)
    rng_keys = []
    if meta.get("world_size") == runtime.world_size:
        rng_keys.append((f"rng/cpu/rank{runtime.rank}", None))
        state[rng_keys[-1][0]] = torch.get_rng_state()
        if runtime.device.type == "cuda":
            rng_keys.append((f"rng/cuda/rank{runtime.rank}", runtime.device))
            state[rng_keys[-1][0]] = torch.cuda.get_rng_state(runtime.device)
    same_layout = meta.get("world_size") == runtime.world_size and meta.get("ep") == runtime.ep_size
    restore_recipe = same_layout and recipe is not None and meta.get("recipe_key") == recipe_key
    if restore_recipe:
        # Build the quantizers under the same autocast the training step uses: they take their
        # amax-reduction group from it.
        with autocast(recipe=recipe, group=dense_group()):
            recipe_state.prepare(model, recipe, recipe_key)
        prefix = f"recipe/rank{runtime.rank}"
        wanted = recipe_state.state_dict(model, prefix)
        saved_keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        restore_recipe = set(wanted) <= saved_keys  # written by this same layout, so present for every rank
        if restore_recipe:
            state.update(wanted)
    meta["restored_recipe_state"] = restore_recipe
    dcp.load(state, checkpoint_id=str(path))
    if restore_recipe:
        recipe_state.load_state_dict(model, state, f"recipe/rank{runtime.rank}")
    with torch.no_grad():
        for target, key, index in bindings:
            (target[index] if index is not None else target).copy_(state[key])
    for key, device in rng_keys:
        if device is None:
            torch.set_rng_state(state[key])
        else:
            torch.cuda.set_rng_state(state[key], device)
    return meta

