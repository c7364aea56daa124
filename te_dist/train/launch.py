"""Start the ranks of ``te-dist train`` under torchrun, supervise them, and stop all of them.

Why torchrun (as a child process) rather than ``mp.spawn``: it is what users run on clusters,
it sets the env:// rendezvous every rank needs, and its agent stops all ranks as soon as one
fails (``--max-restarts 0``). ``--standalone`` picks a free port, so several jobs can share a
machine.

Why the launcher supervises: torchrun starts every rank in a session of its own, so a signal to
the launcher (a supervisor, a scheduler, ``kill``) never reaches the ranks by itself, and torchrun
waits 30 s on a rank that does not exit. The launcher therefore:

    te-dist train ── torchrun (own session, never signalled: it would print a traceback)
                       ├─ rank 0 (own session)    every process carries TE_DIST_JOB_DIR
                       └─ rank 1 (own session)    (job_files.py, processes.py)

    SIGINT / SIGTERM     every rank ready: forward the signal to each rank; they stop after the
                         same step (SIGTERM: after a checkpoint; stop.py), exit 0, torchrun exits 0
                         some rank still starting: kill the job at once (nothing to save yet)
    every rank exited    kill torchrun (its own teardown would only delay the exit)
    stop_grace_s later,  kill torchrun, then every process of the job
    or a second signal
    a rank failed        (its failed.<rank> file) the others get FAILURE_SETTLE_S to report
                         their own errors, then the job is killed

Should the launcher die without a chance to act (SIGKILL), Linux sends torchrun SIGTERM
(``PR_SET_PDEATHSIG``), and torchrun stops the ranks the same way.

Exit code: 128 + the signal (130 SIGINT, 143 SIGTERM) after a signal, else torchrun's. The
ranks print the stop line; the launcher prints one only when it had to kill them.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from . import job_files
from .processes import can_scan, is_tagged, kill_tagged

__all__ = ["default_nproc", "torchrun_command", "launch", "DEFAULT_GRACE_S", "FAILURE_SETTLE_S"]

WORKER_MODULE = "te_dist.train.worker"
DEFAULT_GRACE_S = 8.0  # train.stop_grace_s's default: every process is gone within 10 s of a signal
FAILURE_SETTLE_S = 5.0  # time the other ranks get to report their own errors after one rank failed
_POLL_S = 0.1
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def default_nproc(device: str = "auto") -> int:
    """One rank per GPU when GPUs are used, else 2 CPU ranks."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def torchrun_command(nproc: int, worker_args: Sequence[str]) -> list:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
        "-m", WORKER_MODULE, *worker_args,
    ]


class _Signals:
    """Records SIGINT/SIGTERM while the job runs (main thread only), restores the old handlers after."""

    def __init__(self):
        self.received = []
        self._old = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._record) for sig in _STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def _record(self, signum, frame) -> None:
        self.received.append(signal.Signals(signum))


class _Job:
    """torchrun plus every process that carries this job's TE_DIST_JOB_DIR."""

    def __init__(self, proc: subprocess.Popen, root: Path, nproc: int):
        self.proc, self.root, self.nproc = proc, root, nproc

    def ready(self) -> dict:
        return job_files.ready_pids(self.root)

    def ranks_gone(self) -> bool:
        """Whether every rank that was ready has exited (torchrun then has nothing left to do)."""
        if not can_scan():
            return False
        return not any(is_tagged(pid, job_files.JOB_DIR_ENV, str(self.root)) for pid in self.ready().values())

    def forward(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every ready rank (only to the rank: its children are killed at the end if left)."""
        for pid in self.ready().values():
            if is_tagged(pid, job_files.JOB_DIR_ENV, str(self.root)):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """torchrun first (so it reports nothing about the ranks killed next), then every job process."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        kill_tagged(job_files.JOB_DIR_ENV, str(self.root), fallback=self.ready().values())


def _terminate_with_parent():
    """A ``preexec_fn`` that has Linux send torchrun SIGTERM if the launcher dies (even by SIGKILL,
    which no handler sees): torchrun then stops the ranks itself, so nothing is orphaned."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork: the child only calls it
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def arm() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the line above took effect
            os._exit(1)

    return arm


def launch(nproc: int, worker_args: Sequence[str], *, env: Optional[dict] = None,
           grace_s: float = DEFAULT_GRACE_S) -> int:
    """Run the job and return its exit code: torchrun's (0 only when every rank succeeded), or
    128 + the signal after SIGINT/SIGTERM. ``grace_s``: how long the ranks get to stop after a signal."""
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not grace_s > 0:
        raise ValueError(f"grace_s must be a number of seconds > 0, got {grace_s!r}")
    child_env = dict(os.environ)
    child_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun would set it anyway, with a warning
    child_env.setdefault("PYTHONUNBUFFERED", "1")  # progress lines appear as they happen
    # Make the package importable by the workers even when run from a source checkout.
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, child_env.get("PYTHONPATH")]))
    if env:
        child_env.update(env)
    with tempfile.TemporaryDirectory(prefix="te_dist_job_") as root, _Signals() as signals:
        child_env[job_files.JOB_DIR_ENV] = root
        # How long torchrun itself waits for the ranks when it is signalled (_terminate_with_parent).
        child_env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(math.ceil(grace_s)))
        # Its own session: a terminal's Ctrl-C reaches only the launcher, which decides for the job.
        proc = subprocess.Popen(torchrun_command(nproc, worker_args), env=child_env, start_new_session=True,
                                preexec_fn=_terminate_with_parent())
        job = _Job(proc, Path(root), nproc)
        try:
            return _supervise(job, signals, float(grace_s))
        finally:
            job.kill()  # no process of the job outlives the launcher (nothing left after a clean exit)


def _supervise(job: _Job, signals: _Signals, grace_s: float) -> int:
    deadline, handled, failed = None, 0, False
    while job.proc.poll() is None:
        if len(signals.received) > handled:
            sig = signals.received[0]
            if handled == 0 and len(job.ready()) == job.nproc:
                job.forward(sig)
                deadline = time.monotonic() + grace_s
            else:  # a second signal, or ranks still starting: no more waiting
                job.kill()
                why = "a second signal" if handled else "before every rank had started"
                print(f"te-dist train: interrupted by {sig.name} ({why}); stopped every process of the job",
                      file=sys.stderr, flush=True)
                return 128 + sig
            handled = len(signals.received)
        if deadline is None and job_files.failures(job.root):
            deadline, failed = time.monotonic() + FAILURE_SETTLE_S, True
        if signals.received and job.ranks_gone():  # stopped by themselves: skip torchrun's own teardown
            job.kill()
            break
        if deadline is not None and time.monotonic() >= deadline:
            job.kill()
            if signals.received:
                sig = signals.received[0]
                print(f"te-dist train: interrupted by {sig.name}; the ranks did not stop within {grace_s:g} s "
                      f"(train.stop_grace_s) and were killed", file=sys.stderr, flush=True)
                return 128 + sig
            return 1 if failed else job.proc.returncode
        time.sleep(_POLL_S)
    if signals.received:
        return 128 + signals.received[0]
    return job.proc.returncode
