"""Run directories under the default root: a new one for every run without ``--out``, and ``latest``.

Why: the README's main command (``te-dist train``) must work every time it is run, and a user who
did not pass ``--out`` did not choose a directory for the run to collide with. So without
``train.out_dir`` every run gets a directory of its own, and ``--resume`` continues the newest:

    te_dist_out/20261202-101500/      a run started at 10:15:00
    te_dist_out/20261202-101500-1/    another run started in the same second (or concurrently)
    te_dist_out/latest -> 20261202-101500-1   the newest run (a symlink; a file naming it where
                                              the file system has no symlinks)

A name is taken by ``mkdir``, which the kernel performs atomically: of two runs that try the same
name at once one gets it and the other tries the next suffix, so no two runs share a directory.
``latest`` is replaced atomically (written beside it, then renamed over it). An explicit
``train.out_dir`` (``--out``) is used as given, with the rules of run_dir.py. No torch import:
the CLI parent picks the directory before its first line.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .config import ConfigError

__all__ = ["DEFAULT_ROOT", "LATEST", "OutDirChoice", "choose_out_dir", "new_run_dir", "point_latest",
           "latest_run_dir", "run_dir_names"]

DEFAULT_ROOT = "te_dist_out"
LATEST = "latest"
_STAMP = "%Y%m%d-%H%M%S"
_NAME = re.compile(r"(\d{8}-\d{6})(?:-(\d+))?")
_MAX_SUFFIX = 10_000  # runs started in one second before giving up (a loop bound, never reached in practice)


@dataclass(frozen=True)
class OutDirChoice:
    """The output directory a run uses, and whether it was made for this run."""

    path: Path
    created: bool  # a new directory under the default root (``latest`` is pointed at it once the run starts)
    note: Optional[str] = None  # how it was chosen, for the start-up lines


def new_run_dir(root=DEFAULT_ROOT, *, now: Optional[float] = None) -> Path:
    """Create and return ``root/<date-time>[-<n>]``, a directory no other run has (``now``: seconds
    since the epoch, for tests; default the current time)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime(_STAMP, time.localtime(now))
    for n in range(_MAX_SUFFIX):
        path = root / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"{_MAX_SUFFIX} run directories named {stamp}* exist in {root}; remove some")


def run_dir_names(root=DEFAULT_ROOT) -> list:
    """The run directories under ``root`` (only names this module gives), oldest first."""
    root = Path(root)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = _NAME.fullmatch(path.name)
            if match and path.is_dir() and not path.is_symlink():
                found.append(((match.group(1), int(match.group(2) or 0)), path))
    return [path for _, path in sorted(found)]


def point_latest(root, run_dir) -> None:
    """Make ``root/latest`` name ``run_dir`` (a relative symlink; a file holding its name where
    symlinks cannot be made), replacing the previous pointer atomically."""
    root, name = Path(root), Path(run_dir).name
    tmp = root / f".{LATEST}.{os.getpid()}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    try:
        os.symlink(name, tmp, target_is_directory=True)
    except (OSError, NotImplementedError):
        tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST)


def latest_run_dir(root=DEFAULT_ROOT) -> Optional[Path]:
    """The newest run under ``root``: the one ``latest`` names, else (no pointer, or it names a
    directory that is gone) the newest by name; None when there is none."""
    pointer = Path(root) / LATEST
    name = None
    if pointer.is_symlink():
        name = os.readlink(pointer)
    elif pointer.is_file():
        name = pointer.read_text().strip()
    if name and "/" not in name and (Path(root) / name).is_dir():
        return Path(root) / name
    runs = run_dir_names(root)
    return runs[-1] if runs else None


def choose_out_dir(out_dir: Optional[str], *, resume=None, overwrite: bool = False,
                   root=DEFAULT_ROOT) -> OutDirChoice:
    """The directory a run writes to. ``out_dir`` given: it, unchanged. Otherwise ``--resume``
    (``resume is True``) picks the newest run under ``root`` (a new directory when there is none),
    and any other run gets a new directory. Raises ConfigError for ``--overwrite`` without ``--out``."""
    if out_dir is not None:
        return OutDirChoice(Path(out_dir), created=False)
    if overwrite:
        raise ConfigError(f"--overwrite replaces the run that --out holds: pass --out DIR (without --out "
                          f"every run gets a new directory under {root}/, so there is nothing to replace)")
    if resume is True:
        latest = latest_run_dir(root)
        if latest is not None:
            return OutDirChoice(latest, created=False, note=f"[te-dist] --resume without --out continues the "
                                                            f"newest run under {root}/: {latest}")
        path = new_run_dir(root)
        return OutDirChoice(path, created=True, note=f"[te-dist] --resume: no run under {root}/ yet; "
                                                     f"starting a new one in {path}")
    return OutDirChoice(new_run_dir(root), created=True)
