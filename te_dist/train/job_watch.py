"""What the launcher of ``te-dist train`` waits on, for how long, and the one line that says how the job ended.

Every phase of a job that the launcher waits on has a deadline (docs/launching.md, "Deadlines"):

    phase       from                                 until                                deadline
    start-up    torchrun starts                      every rank has its process groups    train.startup_timeout_s
    a step      (inside the ranks: each collective)                                       train.collective_timeout_s
    a save      a rank begins saving step S          every rank has finished saving S     train.checkpoint_timeout_s
    the exit    a rank has finished the run          every rank has exited                train.exit_grace_s
    a failure   a rank reports its error             (the others report theirs)           FAILURE_SETTLE_S
    a signal    (launch.py)                                                               train.stop_grace_s

The ranks mark the phase boundaries in the job directory (job_files.RankPhase) and a failing rank
writes its error and phase there. When a deadline passes the launcher kills the job (launch.py)
and prints ONE line: the phase, the rank(s) it waited for (stopped, in I/O, exited, or the ones
furthest behind), the deadline and its config field, whether the run's results are complete,
and where the rank logs are. Exit codes: 0 success, 1 failure (results incomplete),
:data:`EXIT_COMPLETE_NOT_EXITED` (3) when the last step and its checkpoint were written but a rank
did not exit cleanly (a hang in process-group teardown or at interpreter exit).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Optional

from . import job_files
from .processes import process_state

__all__ = ["JobLimits", "Outcome", "JobWatch", "EXIT_FAILED", "EXIT_COMPLETE_NOT_EXITED", "FAILURE_SETTLE_S"]

EXIT_FAILED = 1
EXIT_COMPLETE_NOT_EXITED = 3
FAILURE_SETTLE_S = 5.0  # time the other ranks get to report their own errors after one rank failed


@dataclass(frozen=True)
class JobLimits:
    """The launcher's deadlines, in seconds (defaults as the ``train.*`` config fields')."""

    startup_s: float = 600.0  # train.startup_timeout_s
    checkpoint_s: float = 600.0  # train.checkpoint_timeout_s
    exit_grace_s: float = 60.0  # train.exit_grace_s
    stop_grace_s: float = 8.0  # train.stop_grace_s

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"JobLimits.{f.name} must be a number of seconds > 0, got {value!r}")

    @classmethod
    def from_config(cls, train) -> "JobLimits":
        return cls(startup_s=train.startup_timeout_s, checkpoint_s=train.checkpoint_timeout_s,
                   exit_grace_s=train.exit_grace_s, stop_grace_s=train.stop_grace_s)


@dataclass(frozen=True)
class Outcome:
    """How the job ended: the launcher's exit code and its one line for stderr (None: nothing to say)."""

    code: int
    line: Optional[str] = None


def _saved_through(mark: Optional[dict]) -> float:
    """The newest step a rank has finished saving (a rank done with the run has finished them all)."""
    if mark is None:
        return -1
    if mark.get("stage") == "done":
        return float("inf")
    return mark["saved"] if isinstance(mark.get("saved"), int) else -1


def _plural(ranks: list, states: dict) -> str:
    named = ", ".join(f"{r} ({states[r]})" if states.get(r) else str(r) for r in ranks)
    return f"rank {named}" if len(ranks) == 1 else f"ranks {named}"


class JobWatch:
    """Reads the ranks' marks each poll and decides when a deadline has passed (see the module docstring).

    ``rank_pids``: returns {rank: pid} of the ranks' processes, asked only to describe the ranks
    a line names (whether each is stopped, in I/O or gone).
    """

    def __init__(self, root, nproc: int, limits: JobLimits, *, now: float, log_dir=None,
                 rank_pids: Callable[[], dict] = dict):
        self.root, self.nproc, self.limits = Path(root), nproc, limits
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._rank_pids = rank_pids
        self._started_at = now
        self._saves = {}  # step -> when a rank was first seen saving it
        self._done_at = None  # when a rank was first seen done with the run
        self._failed_at = None  # when a rank's failure was first seen

    # ------------------------------------------------------------------ deciding
    def poll(self, now: float) -> Optional[Outcome]:
        """The outcome once a deadline has passed (the caller then kills the job), else None."""
        marks, failed = job_files.progress(self.root), job_files.failures(self.root)
        if failed and self._failed_at is None:
            self._failed_at = now
        for mark in marks.values():
            if mark.get("stage") == "saving" and isinstance(mark.get("step"), int):
                self._saves.setdefault(mark["step"], now)
        if self._done_at is None and any(mark.get("stage") == "done" for mark in marks.values()):
            self._done_at = now
        if self._failed_at is not None and now >= self._failed_at + FAILURE_SETTLE_S:
            return self._failure(failed, marks)
        if len(marks) < self.nproc and now >= self._started_at + self.limits.startup_s:
            return self._startup(marks)
        for step, since in sorted(self._saves.items()):
            if len(marks) == self.nproc and all(_saved_through(m) >= step for m in marks.values()):
                del self._saves[step]
            elif now >= since + self.limits.checkpoint_s:
                return self._save(step, marks)
        if self._done_at is not None and now >= self._done_at + self.limits.exit_grace_s:
            return self._exit(marks)
        return None

    def after_exit(self, returncode: int) -> Outcome:
        """The outcome when torchrun ended by itself."""
        marks, failed = job_files.progress(self.root), job_files.failures(self.root)
        if failed:
            return self._failure(failed, marks)
        if returncode == 0:
            return Outcome(0)
        complete = self._complete(marks)
        if complete:
            return Outcome(EXIT_COMPLETE_NOT_EXITED,
                           f"te-dist train: a rank failed after the run finished (torchrun exit code {returncode}); "
                           f"{complete}: exit code {EXIT_COMPLETE_NOT_EXITED}{self._logs()}")
        return Outcome(returncode, f"te-dist train: the job failed (torchrun exit code {returncode}) without a rank "
                                   f"reporting an error (a rank was killed, e.g. out of memory?); "
                                   f"{self._incomplete(marks)}{self._logs('torchrun.log')}")

    # ------------------------------------------------------------------ lines
    def _logs(self, name: str = "") -> str:
        return f"; logs {self.log_dir / name if name else str(self.log_dir) + '/'}" if self.log_dir else ""

    def _states(self, ranks) -> dict:
        pids = self._rank_pids()
        return {r: process_state(pids[r]) if r in pids else None for r in ranks}

    def _stuck(self, behind: dict) -> tuple:
        """(the ranks that hold the others up, their states): of the unfinished ranks ``behind``
        ({rank: how far it got}), those stopped / in I/O / gone, else those furthest behind."""
        states = self._states(behind)
        abnormal = [r for r in sorted(behind) if states[r]]
        if abnormal:
            return abnormal, states
        least = min(behind.values())
        return [r for r in sorted(behind) if behind[r] == least], states

    @staticmethod
    def _complete(marks: dict) -> Optional[str]:
        """'the run is complete (...)' when a rank finished the whole run, else None."""
        for mark in marks.values():
            if mark.get("stage") == "done" and mark.get("step") is not None and mark["step"] >= mark.get("steps", 0):
                checkpoint = mark.get("checkpoint") or "none (train.checkpoint is false)"
                return f"the run is complete (step {mark['step']}/{mark['steps']}, checkpoint {checkpoint})"
        return None

    @staticmethod
    def _incomplete(marks: dict, before: Optional[int] = None) -> str:
        saved = [m["saved"] for m in marks.values() if isinstance(m.get("saved"), int)]
        if before is not None:
            saved = [s for s in saved if s < before]
        if not saved:
            return "results incomplete: this job wrote no checkpoint"
        return f"results incomplete: the newest checkpoint this job wrote is step {max(saved)} (--resume continues it)"

    def _failure(self, failed: dict, marks: dict) -> Outcome:
        # The first rank to fail names the cause; the others often fail because it did (a closed connection).
        rank = min(failed, key=lambda r: (failed[r].get("at") or float("inf"), r))
        error, phase = failed[rank].get("error", "failed"), failed[rank].get("phase") or "the job"
        error = error.removeprefix(f"rank {rank}: ")
        others = sorted(set(failed) - {rank})
        also = f" ({_plural(others, {})} failed too)" if others else ""
        states = self._states([r for r in range(self.nproc) if r not in failed])
        held_up = [r for r in sorted(states) if states[r] and states[r] != "exited"]
        if held_up:  # e.g. the rank whose silence made this one's collective time out
            also += f"; not responding: {_plural(held_up, states)}"
        complete = self._complete(marks)
        if complete:
            return Outcome(EXIT_COMPLETE_NOT_EXITED, f"te-dist train: rank {rank} failed in {phase}: {error}{also}; "
                                                     f"{complete}: exit code {EXIT_COMPLETE_NOT_EXITED}"
                                                     f"{self._logs(f'rank{rank}.log')}")
        return Outcome(EXIT_FAILED, f"te-dist train: rank {rank} failed in {phase}: {error}{also}; "
                                    f"{self._incomplete(marks)}{self._logs(f'rank{rank}.log')}")

    def _startup(self, marks: dict) -> Outcome:
        ready = job_files.ready_pids(self.root)
        behind = {r: int(r in ready) for r in range(self.nproc) if r not in marks}
        stuck, states = self._stuck(behind)
        for r in stuck:
            if r not in ready and not states[r]:
                states[r] = "not started"
        return Outcome(EXIT_FAILED, f"te-dist train: start-up did not finish within {self.limits.startup_s:g} s "
                                    f"(train.startup_timeout_s): {_plural(stuck, states)} had not joined the job's "
                                    f"process group; the job was killed; no step ran{self._logs()}")

    def _save(self, step: int, marks: dict) -> Outcome:
        behind = {r: int(marks.get(r, {}).get("stage") == "saving" and marks[r].get("step") == step)
                  for r in range(self.nproc) if _saved_through(marks.get(r)) < step}
        stuck, states = self._stuck(behind)
        return Outcome(EXIT_FAILED, f"te-dist train: the checkpoint save of step {step} did not finish within "
                                    f"{self.limits.checkpoint_s:g} s (train.checkpoint_timeout_s): "
                                    f"{_plural(stuck, states)} had not finished it; the job was killed; step {step} "
                                    f"has no checkpoint (a save never leaves a half-written one); "
                                    f"{self._incomplete(marks, before=step)}{self._logs()}")

    def _exit(self, marks: dict) -> Outcome:
        states = self._states(range(self.nproc))
        alive = [r for r in range(self.nproc) if states[r] != "exited"]
        finished = [r for r in range(self.nproc) if marks.get(r, {}).get("stage") == "done"]
        stuck = alive or list(range(self.nproc))
        complete = self._complete(marks)
        verb = "was" if len(stuck) == 1 else "were"
        head = (f"te-dist train: {_plural(stuck, states)} did not exit within {self.limits.exit_grace_s:g} s of "
                f"{_plural(finished[:1], {})} finishing the run (train.exit_grace_s) and {verb} killed; ")
        if complete:
            return Outcome(EXIT_COMPLETE_NOT_EXITED,
                           head + f"{complete}: exit code {EXIT_COMPLETE_NOT_EXITED}{self._logs()}")
        return Outcome(EXIT_FAILED, head + f"{self._incomplete(marks)}{self._logs()}")
