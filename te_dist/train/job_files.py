"""The private job directory through which ``te-dist train`` and its ranks talk.

Why: torchrun starts every rank in a session of its own and tells its parent nothing about
them, so the launcher cannot reach the ranks through process groups. Instead it creates a
directory and passes its path in ``TE_DIST_JOB_DIR``: every process of the job inherits the
variable (the launcher finds them all by it, te_dist.train.processes), and the ranks leave
small files there:

    $TE_DIST_JOB_DIR/ready.<rank>    the rank's pid, once it handles SIGINT/SIGTERM itself
                                     (a rank not ready yet is killed instead of signalled)
    $TE_DIST_JOB_DIR/failed.<rank>   the rank's one-line error (the launcher then ends the job)

Files are written whole (temporary name, then rename), so the launcher never reads half of one.
Without the variable (a plain torchrun) the ranks write nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["JOB_DIR_ENV", "job_dir", "mark_ready", "mark_failed", "ready_pids", "failures"]

JOB_DIR_ENV = "TE_DIST_JOB_DIR"


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


def mark_failed(message: str) -> None:
    """This rank is failing with ``message`` (first line kept)."""
    first = message.strip().splitlines()[0] if message.strip() else "failed"
    _write(f"failed.{_rank()}", first)


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


def failures(root: Path) -> dict:
    """{rank: one-line error} of the ranks that failed."""
    return _read(Path(root), "failed")
