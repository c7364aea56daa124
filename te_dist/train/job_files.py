"""The private job directory through which ``te-dist train`` and its ranks talk.

Why: torchrun starts every rank in a session of its own and tells its parent nothing about
them, so the launcher cannot reach the ranks through process groups. Instead it creates a
directory and passes its path in ``TE_DIST_JOB_DIR``: every process of the job inherits the
variable (the launcher finds them all by it, te_dist.train.processes), and the ranks leave
small files there:

    $TE_DIST_JOB_DIR/ready.<rank>     the rank's pid, once it handles SIGINT/SIGTERM itself
                                      (a rank not ready yet is killed instead of signalled)
    $TE_DIST_JOB_DIR/progress.<rank>  the last phase boundary the rank passed (JSON, :class:`RankPhase`):
                                      started, saving / saved step S, done; the launcher's deadlines
                                      (job_watch.py) run from these
    $TE_DIST_JOB_DIR/failed.<rank>    the rank's one-line error and the phase it failed in (JSON;
                                      the launcher then ends the job)

Files are written whole (temporary name, then rename), so the launcher never reads half of one.
Without the variable (a plain torchrun) the ranks write nothing.

``TE_DIST_LOG_DIR`` (set by the launcher too) is where each rank's stderr goes
(``rank<R>.log``, :func:`redirect_stderr`): tracebacks and warnings stay out of the terminal,
which gets rank 0's progress lines and the launcher's one-line outcome.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

__all__ = ["JOB_DIR_ENV", "LOG_DIR_ENV", "job_dir", "mark_ready", "mark_failed", "ready_pids", "failures",
           "progress", "RankPhase", "redirect_stderr", "rank_log"]

JOB_DIR_ENV = "TE_DIST_JOB_DIR"
LOG_DIR_ENV = "TE_DIST_LOG_DIR"


def job_dir() -> Optional[Path]:
    """This process's job directory, or None outside a ``te-dist train`` job."""
    path = os.environ.get(JOB_DIR_ENV)
    return Path(path) if path else None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write(name: str, text: str) -> None:
    root = job_dir()
    if root is None or not root.is_dir():
        return
    tmp = root / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(text)
    os.replace(tmp, root / name)


def mark_ready() -> None:
    """This rank now turns SIGINT/SIGTERM into a stop at a step boundary (te_dist.train.stop)."""
    _write(f"ready.{_rank()}", str(os.getpid()))


def mark_failed(message: str, phase: Optional[str] = None) -> None:
    """This rank is failing with ``message`` (first line kept) in ``phase`` (e.g. "step 7"). The time
    tells the first failure (the cause) from the failures it set off on the other ranks."""
    first = message.strip().splitlines()[0] if message.strip() else "failed"
    _write(f"failed.{_rank()}", json.dumps({"error": first, "phase": phase, "at": time.time()}))


def rank_log(log_dir, rank: int) -> Path:
    return Path(log_dir) / f"rank{rank}.log"


def redirect_stderr() -> Optional[Path]:
    """Under the launcher: send this process's stderr (file descriptor 2, so C++ messages too) to
    its rank's log, appended after a header line; returns the log's path (None outside a job)."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        return None
    path = rank_log(log_dir, _rank())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, f"==== rank {_rank()} pid {os.getpid()} {time.strftime('%Y-%m-%dT%H:%M:%S%z')} ====\n".encode())
    try:
        sys.stderr.flush()
    except (AttributeError, ValueError):  # no stderr, or a closed one
        pass
    os.dup2(fd, 2)
    os.close(fd)
    return path


class RankPhase:
    """Where this rank is in the job. The launcher reads the marks written at phase boundaries (its
    deadlines start there); a failure record names :attr:`where`. Steps are kept in memory only:
    no file is written per step."""

    def __init__(self):
        self.where = "start-up"
        self._saved = None  # the newest step this rank finished saving (rides on every mark)

    def _mark(self, stage: str, **fields) -> None:
        _write(f"progress.{_rank()}", json.dumps({"stage": stage, "saved": self._saved, **fields}))

    def started(self) -> None:
        """The rank's process groups exist: start-up is over."""
        self._mark("started")

    def step(self, step: int) -> None:
        self.where = f"step {step}"

    def saving(self, step: int) -> None:
        self.where = f"the checkpoint save of step {step}"
        self._mark("saving", step=step)

    def saved(self, step: int) -> None:
        self._saved = step
        self.where = f"step {step} (after its checkpoint)"
        self._mark("saved", step=step)

    def done(self, step: int, steps: int, checkpoint: Optional[str]) -> None:
        """The run returned on this rank: what is left is the process-group teardown and the exit."""
        self.where = "the exit"
        self._mark("done", step=step, steps=steps, checkpoint=checkpoint)


def _read(root: Path, prefix: str) -> dict:
    found = {}
    for path in root.glob(f"{prefix}.*"):
        try:
            found[int(path.name.split(".", 1)[1])] = path.read_text()
        except (OSError, ValueError):  # vanished or not ours: skip
            continue
    return found


def ready_pids(root: Path) -> dict:
    """{rank: pid} of the ranks that are ready."""
    return {rank: int(text) for rank, text in _read(Path(root), "ready").items() if text.strip().isdigit()}


def _json(text: str) -> Optional[dict]:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def failures(root: Path) -> dict:
    """{rank: {"error": one line, "phase": where or None, "at": seconds since the epoch}} of the ranks that failed."""
    return {rank: _json(text) or {"error": text.strip(), "phase": None, "at": None}
            for rank, text in _read(Path(root), "failed").items()}


def progress(root: Path) -> dict:
    """{rank: the rank's last mark} (:class:`RankPhase`: "stage", "step", "saved", ...)."""
    found = {}
    for rank, text in _read(Path(root), "progress").items():
        mark = _json(text)
        if mark is not None:
            found[rank] = mark
    return found
