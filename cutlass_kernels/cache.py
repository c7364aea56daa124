"""The on-disk kernel cache: every entry is whole or absent, and concurrent processes build it once.

Why: eight ranks of one node start together and ask for the same kernel; a crash or a full disk
mid-write must not leave a library that fails on every later start. So an entry is built in a
temp dir, fsynced, renamed into place (atomic), and then *committed* by a second, small file
``<entry>.sha256`` (size and digest of the library) written the same way. An entry without a
matching digest file is absent. A per-key file lock (``locks/<entry>.lock``, ``flock``) makes the
first process build while the others wait and then find the entry; the kernel drops the lock when
its holder dies, so a crashed builder never blocks the rest. A library that is whole on disk but
still fails to load is rebuilt once (:func:`open_cached`); if the rebuilt one fails as well, the
error is a ``BuildError``, which the backends turn into a warning and their fallback path.

Adding a kernel source: compute a target path whose name holds the cache key, and pass a
function that writes the library to a given path's command line; ``build_cached`` does the rest.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Sequence, Tuple, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the atomic rename still keeps entries whole
    fcntl = None

__all__ = ["BuildError", "LOCK_TIMEOUT_S", "build_cached", "open_cached", "entry_is_whole", "lock_path",
           "write_atomic", "try_locked"]

T = TypeVar("T")
Command = Callable[[Path], Sequence[str]]

LOCK_TIMEOUT_S = 3600.0  # a cold CUTLASS build of one instance takes minutes; a wait past this is a hang


class BuildError(RuntimeError):
    """nvcc or the CUTLASS headers are missing, or compilation failed (message has the log tail)."""


def lock_path(target: Path) -> Path:
    return target.parent / "locks" / f"{target.name}.lock"


def _digest_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# Entries this process already hashed, by (path, inode, mtime, size): a library is read once per process.
_whole: Dict[Tuple[str, int, int, int], bool] = {}
_whole_lock = threading.Lock()


def _identity(path: Path) -> Tuple[str, int, int, int]:
    st = path.stat()
    return str(path), st.st_ino, st.st_mtime_ns, st.st_size


def entry_is_whole(target: Path) -> bool:
    """True when ``target`` and its digest file exist and the digest matches the library's bytes."""
    try:
        ident = _identity(target)
        recorded = _digest_path(target).read_text().split()
    except (OSError, ValueError):
        return False
    with _whole_lock:
        if _whole.get(ident):
            return True
    if len(recorded) != 2 or recorded[1] != str(ident[3]) or recorded[0] != _file_digest(target):
        return False
    with _whole_lock:
        _whole[ident] = True
    return True


def _fsync(path: Path) -> None:
    """Flush a file's bytes, or a directory's entries (the rename), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(target: Path, data: bytes) -> None:
    """Replace ``target`` with ``data`` whole or not at all: temp file beside it, fsync, rename,
    fsync the directory. Readers see the old file or the new one, never a torn one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync(target.parent)


@contextmanager
def try_locked(target: Path) -> Iterator[bool]:
    """The per-key lock of ``target`` if no other process holds it: yields True while held, False
    (without waiting) when another process has it. For work another rank may be doing already."""
    if fcntl is None:  # pragma: no cover
        yield True
        return
    path = lock_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the flock


@contextmanager
def _locked(target: Path, timeout_s: float) -> Iterator[None]:
    """Hold the per-key lock of ``target``, waiting for another process's build (asking again
    every 50 ms; the kernel drops a dead holder's lock)."""
    deadline, announced = time.monotonic() + timeout_s, False
    while True:
        with try_locked(target) as mine:
            if mine:
                yield
                return
        if not announced:
            announced = True
            _notice(f"waiting for another process building kernel {target.name}")
        if time.monotonic() > deadline:
            raise BuildError(f"waited {timeout_s:.0f} s for another process building {target.name} (lock "
                             f"{lock_path(target)}); remove the lock file if no build is running")
        time.sleep(0.05)


def _build(target: Path, command: Command, name: str, verbose: bool) -> None:
    """Compile into a temp dir beside ``target``, fsync, rename into place, then commit the digest."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as tmp:
        out = Path(tmp) / target.name
        cmd: List[str] = [str(part) for part in command(out)]
        if verbose:
            print(" ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise BuildError(f"nvcc failed for {name} (rc={proc.returncode}):\n{tail}")
        _fsync(out)
        digest = f"{_file_digest(out)} {out.stat().st_size}\n"
        _digest_path(target).unlink(missing_ok=True)  # uncommit whatever was there before replacing it
        os.replace(out, target)
    write_atomic(_digest_path(target), digest.encode())  # the commit (it fsyncs the directory too)


def _notice(message: str) -> None:
    """One line on stderr: a first-use build stalls the caller (a training step) for about a minute
    per kernel, which must not look like a hang."""
    print(f"te_dist: {message}", file=sys.stderr, flush=True)


def build_cached(target: Path, command: Command, name: str, verbose: bool = False, *,
                 timeout_s: float = LOCK_TIMEOUT_S) -> Path:
    """``target``, built first if its entry is absent or not whole; concurrent callers build it once.
    A build says so on stderr, before and after (``python -m cutlass_kernels`` builds ahead of time)."""
    if entry_is_whole(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target, timeout_s):
        if not entry_is_whole(target):  # the lock holder before us may have built it
            _notice(f"building kernel {name} on first use (about a minute; cache {target.parent}; "
                    f"`python -m cutlass_kernels` builds them ahead of time)")
            start = time.monotonic()
            _build(target, command, name, verbose)
            _notice(f"built kernel {name} in {time.monotonic() - start:.0f} s")
    return target


def _discard(target: Path, failed: Tuple[str, int, int, int], timeout_s: float) -> None:
    """Remove the entry that failed to load, unless another process has replaced it meanwhile."""
    with _locked(target, timeout_s):
        try:
            current = _identity(target)
        except OSError:
            return
        if current == failed:
            _digest_path(target).unlink(missing_ok=True)
            target.unlink(missing_ok=True)
            with _whole_lock:
                _whole.pop(failed, None)


def open_cached(target: Path, command: Command, name: str, open_fn: Callable[[Path], T], verbose: bool = False, *,
                timeout_s: float = LOCK_TIMEOUT_S) -> T:
    """``open_fn(path)`` of the cached library; an entry that fails to open is rebuilt once, and a
    rebuilt one that still fails raises ``BuildError`` (the caller's signal to fall back)."""
    path = build_cached(target, command, name, verbose, timeout_s=timeout_s)
    failed = _identity(path)
    try:
        return open_fn(path)
    except Exception as exc:  # any failure to open means the entry cannot serve: rebuild it once
        first = exc
    _discard(target, failed, timeout_s)
    path = build_cached(target, command, name, verbose, timeout_s=timeout_s)
    try:
        return open_fn(path)
    except Exception as exc:
        raise BuildError(f"{name}: {path} fails to load even after a rebuild ({exc}); the first load failed "
                         f"with: {first}") from exc
