"""The output directory of a run: one run per directory, never two runs' files mixed.

    <out>/.lock                    held by rank 0 while the run lives (run_lock.py)
    <out>/metrics.jsonl            one line per step of this run, each with its run id
    <out>/checkpoints/step_NNNNNN/ whole checkpoints (checkpoint.py, manifest.py)

Without ``train.out_dir`` (no ``--out``) a run gets a new directory under ``te_dist_out/`` and
``--resume`` continues the newest one there (run_dirs.py); the ``te-dist`` parent chooses it, or
rank 0 does under a plain torchrun. Rules for the chosen or given directory (checked by the
``te-dist`` parent before any rank starts, and again by rank 0 under the lock):

- an ``--out`` that holds a run (checkpoints or metrics) is refused, unless ``--resume``
  continues it (from its newest checkpoint that verifies) or ``--overwrite`` replaces it;
- ``--resume DIR`` elsewhere starts a new run in ``--out`` from that checkpoint;
- a resumed run keeps its run id and its metrics up to the resumed step, and appends after it;
- a checkpoint that fails verification is an error naming the file; ``--skip-invalid`` passes over
  it for the newest one that verifies.

Rank 0 decides (:func:`plan_run`), acts (lock, replace, clean, start the metrics file) and
broadcasts the plan or the error, so every rank follows the same plan or raises the same error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch.distributed as dist

from .checkpoint import check_compatible, remove_stale
from .config import PROVENANCE, ConfigError, JobConfig
from .manifest import CheckpointError, list_checkpoints, select_checkpoint, step_of
from .resolved import resolved_config
from .run_dirs import choose_out_dir, point_latest
from .run_lock import RunLock, lock_holder

__all__ = ["RunPlan", "Run", "plan_run", "open_run", "RESUME_LATEST"]

RESUME_LATEST = True  # ``--resume`` without a directory: the newest valid checkpoint in ``--out``
METRICS = "metrics.jsonl"


@dataclass
class RunPlan:
    """What a run does with its output directory (decided by rank 0, followed by every rank)."""

    run_id: str
    checkpoint: Optional[str] = None  # the verified step directory to load; None: start at step 1
    step: int = 0  # the checkpoint's step
    in_place: bool = False  # continuing the run that owns ``--out``
    replace: bool = False  # --overwrite: the previous run's files go first
    history: dict = field(default_factory=dict)  # step -> (run id, loss) up to ``step``, from the checkpoint
    notes: list = field(default_factory=list)  # lines rank 0 prints at start-up
    out_dir: Optional[str] = None  # the directory the run writes to (set by rank 0 under the lock)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def _existing_run(out: Path) -> Optional[str]:
    """A description of the run ``out`` holds (checkpoints, metrics), or None when it holds none."""
    parts = []
    steps = list_checkpoints(out / "checkpoints")
    if steps:
        span = f"{steps[0].name}..{steps[-1].name}" if len(steps) > 1 else steps[0].name
        parts.append(f"checkpoints {span}")
    metrics = out / METRICS
    if metrics.is_file() and metrics.stat().st_size:
        parts.append(METRICS)
    return " and ".join(parts) or None


def _config_changes(saved: dict, now: dict, prefix: str = "") -> list:
    """Dotted keys whose value differs between the checkpoint's resolved config and this run's."""
    changes = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and key != "recipe":
            changes += _config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key} {a!r} -> {b!r}")
    return changes


def plan_run(cfg: JobConfig, *, resume: Union[None, bool, str] = None, overwrite: bool = False,
             skip_invalid: bool = False, check_lock: bool = True) -> RunPlan:
    """Decide what the run does with ``cfg.train.out_dir``; reads only (checksums included).

    ``resume``: None (a new run), :data:`RESUME_LATEST` (continue the run in ``--out``) or a
    checkpoint / output directory to start from. Raises ConfigError (CheckpointError for a bad
    checkpoint) with a one-line message naming the flag or the file.
    """
    out = Path(cfg.train.out_dir)
    if check_lock and (holder := lock_holder(out)) is not None:
        raise ConfigError(f"--out {out} is in use by the live {holder}; wait for it to end or choose another --out")
    existing = _existing_run(out)
    if skip_invalid and resume is None:
        raise ConfigError("--skip-invalid chooses among checkpoints to resume from: it needs --resume")
    if resume is None:
        if existing and not overwrite:
            raise ConfigError(f"--out {out} holds another run ({existing}); pass --resume to continue it, "
                              f"--overwrite to replace it, or choose another --out")
        return RunPlan(new_run_id(), replace=bool(existing))
    source = out if resume is RESUME_LATEST else Path(resume)
    if resume is RESUME_LATEST and not out.is_dir():
        ckpt, meta, notes = None, None, []
    else:
        ckpt, meta, notes = select_checkpoint(source, skip_invalid=skip_invalid)
    if ckpt is None:
        if resume is not RESUME_LATEST:
            raise ConfigError(f"--resume {source}: no checkpoint (a step_* directory) found there")
        if overwrite:
            raise ConfigError("--overwrite replaces the run in --out and --resume continues it: pass only one")
        note = f"[te-dist] no checkpoint in {out}: starting at step 1" + (f", replacing its {existing}" if existing else "")
        return RunPlan(new_run_id(), replace=bool(existing), notes=[note])
    in_place = ckpt.parent.resolve() == (out / "checkpoints").resolve()
    if in_place and overwrite:
        raise ConfigError("--overwrite replaces the run in --out and --resume continues it: pass only one")
    if not in_place and existing and not overwrite:
        raise ConfigError(f"--out {out} holds another run ({existing}); --resume {source} starts a new run there: "
                          f"pass --overwrite to replace it, or choose another --out")
    check_compatible(ckpt, cfg.to_dict()["model"], meta=meta)
    step = meta["step"]
    notes = [f"[te-dist] {line}" for line in notes]
    # Both sides as resolved_config() writes them (recipe names expanded); provenance (versions,
    # ranks) is not a setting.
    now = {k: v for k, v in resolved_config(cfg).items() if k != PROVENANCE}
    changes = _config_changes({k: v for k, v in meta["config"].items() if k != PROVENANCE}, now)
    if changes:
        notes.append(f"[te-dist] settings changed since the checkpoint: {', '.join(changes)}")
    if in_place:
        later = [p.name for p in list_checkpoints(ckpt.parent) if step_of(p) > step]
        if later:
            notes.append(f"[te-dist] checkpoints after step {step} ({', '.join(later)}) are replaced "
                         f"as the run reaches them")
    history = {int(k): (meta["run_id"], loss) for k, loss in meta.get("losses", {}).items() if int(k) <= step}
    return RunPlan(meta["run_id"] if in_place else new_run_id(), str(ckpt), step, in_place,
                   replace=bool(existing) and not in_place, history=history, notes=notes)


class Run:
    """One rank's handle on the run's output directory (rank 0 holds the lock and writes metrics)."""

    def __init__(self, plan: RunPlan, out_dir: Path, lock: Optional[RunLock], is_main: bool):
        self.plan, self.out_dir, self._lock, self.is_main = plan, out_dir, lock, is_main
        self.metrics_path = out_dir / METRICS

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    def append_metrics(self, row: dict) -> None:
        """One line per step, as it happens: a crashed run still leaves its history."""
        if self.is_main:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps({"run": self.run_id, **row}) + "\n")

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _trash(path: Path) -> None:
    """Remove a file or directory; a directory is renamed first, so no half of it looks whole."""
    if path.is_dir():
        doomed = path.with_name(f".{path.name}.deleting")
        shutil.rmtree(doomed, ignore_errors=True)
        path.rename(doomed)
        shutil.rmtree(doomed)
    elif path.exists():
        path.unlink()


def _start_metrics(path: Path, plan: RunPlan) -> list:
    """A new run starts an empty file; a resumed run keeps its own lines up to the resumed step
    (the checkpoint's losses fill any gap) and drops the rest. Returns notes."""
    kept = {step: json.dumps({"run": run_id, "step": step, "loss": loss})
            for step, (run_id, loss) in plan.history.items()}
    dropped = 0
    if plan.in_place and path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                mine = row.get("run") == plan.run_id and int(row["step"]) <= plan.step
            except (ValueError, TypeError, KeyError, AttributeError):
                mine = False
            if mine:
                kept[int(row["step"])] = line
            elif line.strip():
                dropped += 1
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept[step] + "\n" for step in sorted(kept)))
    os.replace(tmp, path)
    return [f"[te-dist] {METRICS}: kept steps 1..{plan.step}, dropped {dropped} later line(s)"] if dropped else []


def _claim(cfg: JobConfig, resume, overwrite: bool, skip_invalid: bool) -> tuple:
    """Rank 0: choose the directory (``--out``, else run_dirs.py), lock it, plan, then make the directory
    match the plan. Returns (plan, lock)."""
    chosen = choose_out_dir(cfg.train.out_dir, resume=resume, overwrite=overwrite)
    if chosen.created:
        point_latest(chosen.path.parent, chosen.path)
    out = chosen.path
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(out)))
    lock = RunLock(out).acquire()
    try:
        plan = plan_run(cfg, resume=resume, overwrite=overwrite, skip_invalid=skip_invalid, check_lock=False)
    except BaseException:
        lock.release()
        raise
    lock.record(plan.run_id)
    plan.out_dir = str(out)
    if chosen.note:
        plan.notes.insert(0, chosen.note)
    elif chosen.created:
        plan.notes.insert(0, f"[te-dist] run directory {out} (new; {out.parent}/latest names it)")
    if lock.stale:
        plan.notes.append(f"[te-dist] took over the lock left by {lock.stale}, which is no longer alive")
    if plan.replace:
        for name in ("checkpoints", METRICS):
            _trash(out / name)
        plan.notes.append(f"[te-dist] --overwrite: removed the previous run's checkpoints and {METRICS} from {out}")
    stale = remove_stale(out / "checkpoints")
    if stale:
        plan.notes.append(f"[te-dist] removed what interrupted saves left: {', '.join(stale)}")
    plan.notes += _start_metrics(out / METRICS, plan)
    return plan, lock


def open_run(cfg: JobConfig, runtime, *, resume=None, overwrite: bool = False, skip_invalid: bool = False) -> Run:
    """Collective: rank 0 claims ``--out`` and plans the run; every rank gets the plan or raises
    the same error (ConfigError, CheckpointError) naming the flag or the file. ``run.out_dir`` is
    the directory chosen (``cfg.train.out_dir``, or a new one under te_dist_out/ when that is None)."""
    message = [None]
    lock = None
    if runtime.is_main:
        try:
            plan, lock = _claim(cfg, resume, overwrite, skip_invalid)
            message = [plan]
        except CheckpointError as exc:
            message = [("checkpoint", str(exc.path), exc.problem)]
        except ConfigError as exc:
            message = [("config", str(exc))]
        except Exception as exc:  # e.g. an unwritable --out: still tell every rank, so none waits
            where = cfg.train.out_dir or "(a new directory under te_dist_out/)"
            message = [("error", f"rank 0 could not prepare --out {where}: {type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(message, src=0)
    got = message[0]
    if isinstance(got, tuple):
        kind, *args = got
        raise {"checkpoint": CheckpointError, "config": ConfigError, "error": RuntimeError}[kind](*args)
    if runtime.is_main:
        for note in got.notes:
            print(note, flush=True)
    return Run(got, Path(got.out_dir), lock, runtime.is_main)
