"""Distributed checkpoints (torch.distributed.checkpoint) that reload at any EP size, whole or absent.

Why one key per global expert: a rank holding experts [k*E_local, (k+1)*E_local) writes
``model/<param>/expert<e>`` for each of them; a rank of a job with another EP size simply asks
for the experts it now owns. Dense tensors are written under the same key by every rank and
DCP keeps one copy. Optimizer state (AdamW ``exp_avg``, ``exp_avg_sq``, ``step``) follows the
same keys, so a resumed run continues bit-exactly on CPU.

Why a temporary directory: a save that dies half-way (a crash, a kill, a full disk) must never
leave a directory that looks like a checkpoint. Every rank writes into ``.step_NNNNNN.partial``
(DCP fsyncs each file); the ranks checksum the files; rank 0 writes ``meta.json`` (manifest.py)
and only then renames the directory to ``step_NNNNNN``. A step directory is never written into.

    <out>/checkpoints/step_000020/        DCP shards (.distcp) + .metadata + meta.json
    <out>/checkpoints/.step_000040.partial   a save in progress (removed when the next run starts)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..autocast import autocast
from ..distributed.bounded import wait_collective
from . import recipe_state
from .config import ConfigError
from .manifest import (CheckpointError, file_digest, fsync_dir, list_checkpoints, read_manifest, select_checkpoint,
                       step_of, verify_checkpoint, write_manifest)
from .parallel import Runtime, dense_group, expert_parameter_names, global_expert_ids

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "checkpoint_dir", "read_meta", "check_compatible",
           "prune_checkpoints", "remove_stale", "CheckpointError"]

_OPT_KEYS = ("exp_avg", "exp_avg_sq")
_MARKS = (".partial", ".superseded", ".deleting")  # suffixes of directories that are never checkpoints
_META_NEEDS = ("model", "run_id", "config")


def _dcp():
    """torch.distributed.checkpoint, imported on first use: it pulls in DTensor and sympy (seconds),
    which the ``te-dist`` parent, checking a run before any rank starts, does not need."""
    import torch.distributed.checkpoint as dcp

    return dcp


def checkpoint_dir(out_dir, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step:06d}"


def read_meta(path) -> dict:
    """The manifest of a step directory (shape and its own checksum checked; files not re-read)."""
    return read_manifest(path)


def find_checkpoint(path, *, skip_invalid: bool = False) -> Path:
    """The checkpoint ``--resume path`` loads: ``path`` itself when it is a step directory, else the
    newest one under it, which must verify (with ``skip_invalid``: the newest that verifies)."""
    found, _, _ = select_checkpoint(path, skip_invalid=skip_invalid)
    if found is None:
        raise ConfigError(f"--resume {path}: no checkpoint (a step_* directory) found there")
    return found


def _marked(root: Path, name: str, mark: str) -> Path:
    return root / f".{name}{mark}"


def _remove(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def remove_stale(root) -> list:
    """Remove what interrupted saves and deletions left in a ``checkpoints`` dir (only while no
    save can be running: the caller holds the output directory's lock). Returns the names."""
    root = Path(root)
    stale = [p for p in root.iterdir() if p.name.startswith(".") and p.name.endswith(_MARKS)] if root.is_dir() else []
    for path in stale:
        _remove(path)
    return sorted(p.name for p in stale)


def prune_checkpoints(root, keep_last: int, *, newest: int) -> list:
    """Delete all but the ``keep_last`` newest checkpoints up to step ``newest``; returns the deleted.

    Checkpoints after ``newest`` (left by the attempt a resumed run restarted from) are not
    counted or touched. A directory is renamed before it is deleted, so a crash in between never
    leaves a half-deleted ``step_*`` directory.
    """
    root = Path(root)
    if keep_last <= 0:
        return []
    candidates = [p for p in list_checkpoints(root) if step_of(p) <= newest]
    doomed = candidates[:-keep_last]
    for path in doomed:
        trash = _marked(root, path.name, ".deleting")
        _remove(trash)
        path.rename(trash)
        _remove(trash)
    return doomed


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


def check_compatible(path, model_config: dict, *, meta: Optional[dict] = None) -> dict:
    """The checkpoint's meta, after checking it was written for the same model shape (EP may differ)."""
    meta = read_meta(path) if meta is None else meta
    saved = meta.get("model", {})
    diff = {k: (saved.get(k), model_config.get(k)) for k in _SHAPE_KEYS if saved.get(k) != model_config.get(k)}
    if diff:
        text = ", ".join(f"model.{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
        raise ConfigError(f"checkpoint {path} was written for another model shape ({text})")
    return meta


def _digest_files(directory: Path, runtime: Runtime, group) -> dict:
    """{file name: {"size", "sha256"}} of every file in ``directory`` (collective: the ranks share the reading)."""
    names = [sorted(p.name for p in directory.iterdir()) if runtime.is_main else None]
    dist.broadcast_object_list(names, src=0, group=group)
    mine = {name: file_digest(directory / name) for name in names[0][runtime.rank :: runtime.world_size]}
    gathered = [None] * runtime.world_size
    dist.all_gather_object(gathered, mine, group=group)
    return {name: entry for part in gathered for name, entry in part.items()}


def _barrier(group, what: str) -> None:
    """A barrier of the save, waited with the group's timeout and named when it fails (bounded.py)."""
    limit = "train.checkpoint_timeout_s" if group is not None else "train.collective_timeout_s"
    wait_collective(dist.barrier(group=group, async_op=True), f"checkpoint save barrier ({what})", group,
                    limit_name=limit)


def _publish(partial: Path, final: Path) -> None:
    """Rename the finished ``partial`` directory to ``final``; an existing ``final`` (a step reached
    again after resuming from an earlier checkpoint) is moved aside first, never written into."""
    root = final.parent
    if final.exists():
        aside = _marked(root, final.name, ".superseded")
        _remove(aside)
        final.rename(aside)
        partial.rename(final)
        fsync_dir(root)
        _remove(aside)
    else:
        partial.rename(final)
    fsync_dir(root)


def save_checkpoint(path, *, model, optimizer, runtime: Runtime, step: int, meta: dict, keep_last: int = 0) -> Path:
    """Collective: write the checkpoint of ``step`` to ``path`` (a ``step_NNNNNN`` directory).

    ``meta`` must hold ``model``, ``run_id`` and ``config`` (the resolved config as a dict); it is
    stored in ``meta.json`` with the step, the layout and every file's checksum. ``keep_last`` > 0
    then deletes all but the newest ``keep_last`` checkpoints beside it. The save's collectives run
    on ``runtime.checkpoint_group`` (its timeout is train.checkpoint_timeout_s), else the default group.
    """
    final = Path(path)
    missing = [key for key in _META_NEEDS if key not in meta]
    if missing:
        raise ValueError(f"save_checkpoint: meta needs the keys {list(_META_NEEDS)}, missing {missing}")
    partial = _marked(final.parent, final.name, ".partial")
    group = runtime.checkpoint_group
    if runtime.is_main:
        _remove(partial)  # what an interrupted save of this step left behind
        partial.mkdir(parents=True)
    _barrier(group, "the partial directory exists")
    state, _ = _state_for(model, optimizer, runtime, for_load=False)
    state[f"rng/cpu/rank{runtime.rank}"] = torch.get_rng_state()
    if runtime.device.type == "cuda":
        state[f"rng/cuda/rank{runtime.rank}"] = torch.cuda.get_rng_state(runtime.device)
    state.update(recipe_state.state_dict(model, f"recipe/rank{runtime.rank}"))
    dcp = _dcp()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial), sync_files=True), process_group=group)
    _barrier(group, "every shard written")
    files = _digest_files(partial, runtime, group)
    if runtime.is_main:
        write_manifest(partial, dict(meta, step=step, world_size=runtime.world_size, ep=runtime.ep_size), files)
        _publish(partial, final)
        prune_checkpoints(final.parent, keep_last, newest=step)
    _barrier(group, "the commit")
    return final


def _verified_on_rank0(path: Path, runtime: Runtime) -> None:
    """Rank 0 re-reads every file; every rank raises the same CheckpointError when one differs."""
    problem = [None]
    if runtime.is_main:
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            problem = [(str(exc.path), exc.problem)]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(*problem[0])


def load_checkpoint(path, *, model, optimizer, runtime: Runtime, model_config: dict, recipe=None,
                    recipe_key=None, verify: bool = True) -> dict:
    """Fill ``model`` and ``optimizer`` from ``path`` (collective); returns its meta dict.

    ``verify``: re-read every file against meta.json first (pass False only when the caller just
    did, e.g. after :func:`~te_dist.train.manifest.select_checkpoint`).
    The model shape must match the checkpoint's; the EP size and the number of ranks may differ.
    Per-rank RNG states are restored only when the number of ranks is unchanged, recipe state
    (amax histories) only when the ranks, the EP size and the recipe key are unchanged;
    ``meta["restored_recipe_state"]`` says which happened.
    """
    path = Path(path)
    if verify:
        _verified_on_rank0(path, runtime)
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
        saved_keys = set(_dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        restore_recipe = set(wanted) <= saved_keys  # written by this same layout, so present for every rank
        if restore_recipe:
            state.update(wanted)
    meta["restored_recipe_state"] = restore_recipe
    _dcp().load(state, checkpoint_id=str(path))
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

