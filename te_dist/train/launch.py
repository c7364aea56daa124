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
    a deadline passed    start-up, a checkpoint save, the exit after the run, the settling after a
                         rank's failure (job_watch.py): kill the job, print one line saying so

Should the launcher die without a chance to act (SIGKILL), Linux sends torchrun SIGTERM
(``PR_SET_PDEATHSIG``), and torchrun stops the ranks the same way.

With a ``log_dir`` every rank's stderr goes to ``<log_dir>/rank<R>.log`` and torchrun's to
``<log_dir>/torchrun.log``: the terminal gets rank 0's progress and the launcher's one line.

Exit code: 128 + the signal (130 SIGINT, 143 SIGTERM) after a signal, else job_watch.py's (0
success, 1 failure, 3 a complete run whose rank did not exit cleanly). The ranks print the stop
line; the launcher prints one when it had to kill the job, or when the job failed.
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
from .job_watch import JobLimits, JobWatch
from .processes import can_scan, environ_value, is_tagged, kill_tagged, tagged_processes

__all__ = ["default_nproc", "torchrun_command", "launch"]

WORKER_MODULE = "te_dist.train.worker"
TORCHRUN_LOG = "torchrun.log"
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

    def rank_pids(self) -> dict:
        """{rank: pid}: the ready ranks' pids, and (Linux) the job's other processes that carry a RANK."""
        pids = self.ready()
        if len(pids) < self.nproc and can_scan():
            for pid in tagged_processes(job_files.JOB_DIR_ENV, str(self.root)) or ():
                rank = environ_value(pid, "RANK")
                if pid != self.proc.pid and rank is not None and rank.isdigit():
                    pids.setdefault(int(rank), pid)
        return pids

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
           limits: Optional[JobLimits] = None, log_dir=None) -> int:
    """Run the job and return its exit code (module docstring). ``limits``: the deadlines
    (job_watch.py; default :class:`JobLimits`()); ``log_dir``: where the rank logs go (None: the
    ranks write to this process's stderr)."""
    limits = JobLimits() if limits is None else limits
    if not isinstance(limits, JobLimits):
        raise TypeError(f"limits must be a JobLimits, got {type(limits).__name__}")
    child_env = dict(os.environ)
    child_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun would set it anyway, with a warning
    child_env.setdefault("PYTHONUNBUFFERED", "1")  # progress lines appear as they happen
    # Make the package importable by the workers even when run from a source checkout.
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, child_env.get("PYTHONPATH")]))
    if env:
        child_env.update(env)
    if log_dir is not None:
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        child_env[job_files.LOG_DIR_ENV] = str(log_dir)
    with tempfile.TemporaryDirectory(prefix="te_dist_job_") as root, _Signals() as signals:
        child_env[job_files.JOB_DIR_ENV] = root
        # How long torchrun itself waits for the ranks when it is signalled (_terminate_with_parent).
        child_env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(math.ceil(limits.stop_grace_s)))
        stderr = _torchrun_log(log_dir)
        # Its own session: a terminal's Ctrl-C reaches only the launcher, which decides for the job.
        try:
            proc = subprocess.Popen(torchrun_command(nproc, worker_args), env=child_env, start_new_session=True,
                                    preexec_fn=_terminate_with_parent(), stderr=stderr)
        finally:
            if stderr is not None:
                stderr.close()  # torchrun holds its own copy
        job = _Job(proc, Path(root), nproc)
        watch = JobWatch(root, nproc, limits, now=time.monotonic(), log_dir=log_dir, rank_pids=job.rank_pids)
        try:
            return _supervise(job, signals, watch, float(limits.stop_grace_s))
        finally:
            job.kill()  # no process of the job outlives the launcher (nothing left after a clean exit)


def _torchrun_log(log_dir: Optional[Path]):
    """torchrun's stderr (its warnings, its failure summaries): ``<log_dir>/torchrun.log``, appended."""
    if log_dir is None:
        return None
    log = open(log_dir / TORCHRUN_LOG, "a")
    log.write(f"==== torchrun {time.strftime('%Y-%m-%dT%H:%M:%S%z')} ====\n")
    log.flush()
    return log


def _say(line: Optional[str]) -> None:
    if line:
        print(line, file=sys.stderr, flush=True)


def _supervise(job: _Job, signals: _Signals, watch: JobWatch, grace_s: float) -> int:
    deadline, handled = None, 0
    while job.proc.poll() is None:
        if len(signals.received) > handled:
            sig = signals.received[0]
            if handled == 0 and len(job.ready()) == job.nproc:
                job.forward(sig)
                deadline = time.monotonic() + grace_s
            else:  # a second signal, or ranks still starting: no more waiting
                job.kill()
                why = "a second signal" if handled else "before every rank had started"
                _say(f"te-dist train: interrupted by {sig.name} ({why}); stopped every process of the job")
                return 128 + sig
            handled = len(signals.received)
        if signals.received:  # stopping: only the stop's own deadline applies
            if job.ranks_gone():  # stopped by themselves: skip torchrun's own teardown
                job.kill()
                break
            if time.monotonic() >= deadline:
                job.kill()
                sig = signals.received[0]
                _say(f"te-dist train: interrupted by {sig.name}; the ranks did not stop within {grace_s:g} s "
                     f"(train.stop_grace_s) and were killed")
                return 128 + sig
        else:
            outcome = watch.poll(time.monotonic())
            if outcome is not None:
                job.kill()
                _say(outcome.line)
                return outcome.code
        time.sleep(_POLL_S)
    if signals.received:
        return 128 + signals.received[0]
    outcome = watch.after_exit(job.proc.returncode)
    _say(outcome.line)
    return outcome.code
