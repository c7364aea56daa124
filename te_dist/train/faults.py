"""Testing aid: make one rank of ``te-dist train`` fail or hang at a chosen point of the job.

Why: every way a rank can end a job (an error, a hang at start-up, mid-step, in a checkpoint save,
at exit) must end it within a bound and with one named line; the tests provoke each one
deterministically with the hidden flags ``--fail-rank R --fail-step S --fail-with raise|stop
--fail-at startup|step|save|exit``. ``stop`` is a real SIGSTOP of the rank's own process: it
looks to its peers and to the launcher exactly as a rank that stopped responding.
No torch import (the flags are parsed in the ``te-dist`` parent).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Optional

__all__ = ["FaultInjection", "FAULT_ACTIONS", "FAULT_POINTS"]

FAULT_ACTIONS = ("raise", "stop")
FAULT_POINTS = ("startup", "step", "save", "exit")


@dataclass(frozen=True)
class FaultInjection:
    """Testing aid: on ``rank`` at ``point`` ("startup": before joining the process group; "step": the
    start of ``step``; "save": inside the checkpoint save of ``step``; "exit": after the run, before
    the teardown), raise (``action="raise"``: a failing rank) or stop the process with SIGSTOP
    (``action="stop"``: a hung rank). Shows how each ends a job."""

    rank: int
    step: int = 1
    action: str = "raise"
    point: str = "step"

    def __post_init__(self):
        if self.action not in FAULT_ACTIONS:
            raise ValueError(f"FaultInjection.action must be one of {list(FAULT_ACTIONS)}, got {self.action!r}")
        if self.point not in FAULT_POINTS:
            raise ValueError(f"FaultInjection.point must be one of {list(FAULT_POINTS)}, got {self.point!r}")

    def at(self, rank: int, point: str, step: Optional[int] = None) -> None:
        """Act when this is the rank, point (and step) asked for; a stopped process resumes on SIGCONT."""
        if rank != self.rank or point != self.point or (point in ("step", "save") and step != self.step):
            return
        if self.action == "stop":
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        where = {"step": f"step {step}", "save": f"the save of step {step}"}.get(point, point)
        raise RuntimeError(f"injected failure on rank {rank} at {where} (--fail-rank/--fail-step)")
