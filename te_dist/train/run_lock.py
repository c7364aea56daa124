"""The lock of an output directory: one live run writes into it at a time.

Why ``flock`` rather than a pid file: the kernel drops the lock when its holder dies, however it
dies (SIGKILL, OOM kill, a node reboot), so a dead run's lock is stale by construction and no pid
has to be guessed alive (pids are reused, and another host's pid cannot be checked). The file
also records who holds it (pid, host, run id, start time) for the error message; its content
outliving an unlocked file is how a run that ended without releasing it is recognised. On NFS,
Linux maps ``flock`` to POSIX byte-range locks, which NFSv4 servers honour across clients.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from .config import ConfigError

__all__ = ["RunLock", "lock_holder", "LOCK_NAME"]

LOCK_NAME = ".lock"


def _describe(record: dict) -> str:
    return (f"run {record.get('run_id', '?')} (pid {record.get('pid', '?')} on {record.get('host', '?')}, "
            f"started {record.get('started', '?')})")


def _read_record(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    try:
        record = json.loads(raw.decode()) if raw.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        record = {"pid": "unknown (unreadable lock file)"}
    return record if isinstance(record, dict) else {}


def lock_holder(out_dir) -> Optional[str]:
    """Who holds ``out_dir``'s lock, if a live process does (probes without taking it); else None."""
    path = Path(out_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe(_read_record(fd))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class RunLock:
    """Held by rank 0 from the start of a run to its end (or its death)."""

    def __init__(self, out_dir):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self._fd: Optional[int] = None
        self.stale: Optional[str] = None  # the dead run whose leftover lock record was taken over

    def acquire(self, run_id: str = "(starting)") -> "RunLock":
        """Take the lock or raise ConfigError naming the live run that holds it."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_record(fd))
            os.close(fd)
            raise ConfigError(f"--out {self.out_dir} is in use by the live {holder}; wait for it to end or choose "
                              f"another --out (lock file {self.path})") from None
        leftover = _read_record(fd)
        self.stale = _describe(leftover) if leftover else None
        self._fd = fd
        self.record(run_id)
        return self

    def record(self, run_id: str) -> None:
        """Write who holds the lock (rank 0 learns its run id only after planning under the lock)."""
        record = {"run_id": run_id, "pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)
        os.fsync(self._fd)

    def release(self) -> None:
        """Empty the record and unlock. The file stays: unlinking it would race with a run that just opened it."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
