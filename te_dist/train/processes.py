"""Find every process of a job by an environment variable its launcher set, and kill them.

Why the environment and not the process tree: torchrun puts each rank in a session of its own,
and a rank whose torchrun died is re-parented to init, so neither process groups nor parent
links reach every process of a job. A variable set by the launcher (``TE_DIST_JOB_DIR``, a
unique path) is inherited by torchrun, the ranks and anything they start, and cannot match a
stranger, so a pid found by it is never a reused one. Linux only (``/proc/<pid>/environ``);
elsewhere :func:`tagged_processes` returns None and callers fall back to the pids they know.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

__all__ = ["can_scan", "tagged_processes", "is_tagged", "kill_tagged", "environ_value", "process_state"]

_PROC = Path("/proc")


def can_scan() -> bool:
    """Whether processes can be found by their environment here (Linux /proc)."""
    return _PROC.is_dir()


def _environ(pid: int) -> list:
    """``pid``'s environment entries (``b"NAME=value"``); empty when gone, a zombie, or another user's."""
    try:
        return (_PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return []


def _environ_has(pid: int, entry: bytes) -> bool:
    return entry in _environ(pid)


def _state_letter(pid: int) -> Optional[str]:
    """The kernel's one-letter state of ``pid`` (R, S, D, T, t, Z, ...), None when it is gone."""
    try:
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _is_zombie(pid: int) -> bool:
    return _state_letter(pid) in (None, "Z")


# What a state says about a rank that holds up its job (running and sleeping say nothing).
_STATE_WORDS = {"T": "stopped", "t": "stopped", "D": "in uninterruptible I/O", "Z": "exited", None: "exited"}


def process_state(pid: int) -> Optional[str]:
    """"stopped" (SIGSTOP, a debugger), "in uninterruptible I/O", "exited", or None (running or
    sleeping, or unknown without /proc): the words the launcher adds to a rank it names."""
    if not can_scan():
        return None
    return _STATE_WORDS.get(_state_letter(pid))


def environ_value(pid: int, name: str) -> Optional[str]:
    """The value of ``name`` in ``pid``'s environment (None: unset, gone, or unreadable)."""
    prefix = f"{name}=".encode()
    for entry in _environ(pid):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


def is_tagged(pid: int, name: str, value: str) -> bool:
    """Whether ``pid`` is a live process whose environment holds ``name=value``."""
    return _environ_has(pid, f"{name}={value}".encode()) and not _is_zombie(pid)


def tagged_processes(name: str, value: str) -> Optional[list]:
    """Pids of the live processes (other than this one) whose environment holds ``name=value``."""
    if not can_scan():
        return None
    entry, me = f"{name}={value}".encode(), os.getpid()
    found = []
    for path in _PROC.iterdir():
        if path.name.isdigit() and int(path.name) != me and _environ_has(int(path.name), entry):
            if not _is_zombie(int(path.name)):
                found.append(int(path.name))
    return found


def kill_tagged(name: str, value: str, *, fallback=(), timeout_s: float = 3.0) -> list:
    """SIGKILL every tagged process until none is left or ``timeout_s`` passes; returns the survivors
    (none unless a process is stuck in the kernel). Without /proc, the ``fallback`` pids are killed."""
    if tagged_processes(name, value) is None:
        _kill_all(fallback)
        return []
    deadline = time.monotonic() + timeout_s
    while True:
        victims = tagged_processes(name, value)
        if not victims or time.monotonic() > deadline:
            return victims
        _kill_all(victims)
        time.sleep(0.05)


def _kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
