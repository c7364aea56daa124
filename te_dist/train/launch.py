"""Start the ranks of ``te-dist train`` under torchrun and wait for them.

Why torchrun (as a child process) rather than ``mp.spawn``: it is what users run on clusters,
it sets the env:// rendezvous every rank needs, and its agent stops all ranks as soon as one
fails (``--max-restarts 0``), printing that rank's traceback, so a job never hangs on a dead
peer. ``--standalone`` picks a free port, so several jobs can share a machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional, Sequence

__all__ = ["default_nproc", "torchrun_command", "launch"]

WORKER_MODULE = "te_dist.train.worker"


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


def launch(nproc: int, worker_args: Sequence[str], *, env: Optional[dict] = None) -> int:
    """Run the job; returns torchrun's exit code (0 only when every rank succeeded)."""
    child_env = dict(os.environ)
    child_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun would set it anyway, with a warning
    child_env.setdefault("PYTHONUNBUFFERED", "1")  # progress lines appear as they happen
    # Make the package importable by the workers even when run from a source checkout.
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, child_env.get("PYTHONPATH")]))
    if env:
        child_env.update(env)
    proc = subprocess.Popen(torchrun_command(nproc, worker_args), env=child_env)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the workers got the same SIGINT from the terminal; let torchrun tidy up
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
