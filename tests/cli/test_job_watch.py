"""The launcher's deadlines (job_watch.py) on marks written as ranks write them, with a clock the test moves.

A real stopped process stands in for a stuck rank, so the line's "(stopped)" comes from /proc as in a job.
The end-to-end cases (real torchrun, each phase) are in test_signals.py.
"""

import signal
import subprocess
import sys
import time

import pytest

from te_dist.train import job_files
from te_dist.train.job_watch import EXIT_COMPLETE_NOT_EXITED, JobLimits, JobWatch, Outcome
from te_dist.train.processes import can_scan, process_state

needs_proc = pytest.mark.skipif(not can_scan(), reason="process states are read from Linux /proc")
LIMITS = JobLimits(startup_s=5, checkpoint_s=7, exit_grace_s=2, stop_grace_s=1)


@pytest.fixture
def job(tmp_path, monkeypatch):
    """(job dir, {rank: RankPhase writing as that rank}, set_rank)."""
    root = tmp_path / "job"
    root.mkdir()
    monkeypatch.setenv(job_files.JOB_DIR_ENV, str(root))
    phases = {0: job_files.RankPhase(), 1: job_files.RankPhase()}

    def as_rank(rank):
        monkeypatch.setenv("RANK", str(rank))
        return phases[rank]

    return root, as_rank


@pytest.fixture
def stopped_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while process_state(proc.pid) != "stopped":  # the signal is delivered asynchronously
        assert time.monotonic() < deadline, "the stand-in process never stopped"
        time.sleep(0.01)
    yield proc.pid
    proc.kill()
    proc.wait()


def _every_rank(as_rank, *marks) -> None:
    """Each mark (a RankPhase method name and its arguments), written by rank 0 then rank 1."""
    for rank in (0, 1):
        for name, *args in marks:
            getattr(as_rank(rank), name)(*args)


def _watch(root, tmp_path, pids=None) -> JobWatch:
    return JobWatch(root, 2, LIMITS, now=100.0, log_dir=tmp_path / "logs", rank_pids=lambda: dict(pids or {}))


@needs_proc
def test_start_up_names_the_rank_that_never_joined(job, tmp_path, stopped_pid):
    root, as_rank = job
    as_rank(0).started()
    watch = _watch(root, tmp_path, {1: stopped_pid})
    assert watch.poll(104.9) is None
    outcome = watch.poll(105.0)
    assert outcome.code == 1
    assert outcome.line == (f"te-dist train: start-up did not finish within 5 s (train.startup_timeout_s): rank 1 "
                            f"(stopped) had not joined the job's process group; the job was killed; no step ran; "
                            f"logs {tmp_path / 'logs'}/")
    assert "rank 1 (not started)" in _watch(root, tmp_path).poll(106.0).line  # no process found for it
    as_rank(1).started()
    assert _watch(root, tmp_path).poll(1000.0) is None  # every rank joined: start-up is over


@needs_proc
def test_a_save_that_does_not_finish_is_named_and_a_finished_one_is_not(job, tmp_path, stopped_pid):
    root, as_rank = job
    _every_rank(as_rank, ("started",), ("saving", 2))
    watch = _watch(root, tmp_path, {1: stopped_pid})
    assert watch.poll(100.0) is None
    _every_rank(as_rank, ("saved", 2))
    assert watch.poll(108.0) is None  # saved by every rank before its deadline
    _every_rank(as_rank, ("saving", 4))
    assert watch.poll(110.0) is None
    as_rank(0).saved(4)
    assert watch.poll(116.9) is None
    outcome = watch.poll(117.0)
    assert outcome.code == 1
    assert outcome.line.startswith("te-dist train: the checkpoint save of step 4 did not finish within 7 s "
                                   "(train.checkpoint_timeout_s): rank 1 (stopped) had not finished it; the job was "
                                   "killed; step 4 has no checkpoint"), outcome.line
    assert "the newest checkpoint this job wrote is step 2" in outcome.line


@needs_proc
def test_a_rank_that_does_not_exit_after_the_run(job, tmp_path, stopped_pid):
    root, as_rank = job
    _every_rank(as_rank, ("started",), ("saving", 6), ("saved", 6), ("done", 6, 6, "run/checkpoints/step_000006"))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    watch = _watch(root, tmp_path, {0: gone.pid, 1: stopped_pid})
    assert watch.poll(100.0) is None and watch.poll(101.9) is None
    outcome = watch.poll(102.0)
    assert outcome == Outcome(EXIT_COMPLETE_NOT_EXITED, (
        "te-dist train: rank 1 (stopped) did not exit within 2 s of rank 0 finishing the run (train.exit_grace_s) "
        "and was killed; the run is complete (step 6/6, checkpoint run/checkpoints/step_000006): exit code 3; "
        f"logs {tmp_path / 'logs'}/"))


@needs_proc
def test_a_failure_is_one_line_with_the_phase_the_stuck_peer_and_the_log(job, tmp_path, stopped_pid):
    root, as_rank = job
    _every_rank(as_rank, ("started",), ("step", 7))
    as_rank(0)
    job_files.mark_failed("rank 0: loss all-reduce (group ranks [0, 1]) did not finish within 3 s", "step 7")
    watch = _watch(root, tmp_path, {1: stopped_pid})
    assert watch.poll(100.0) is None and watch.poll(104.9) is None  # the others may still report
    outcome = watch.poll(105.0)
    assert outcome.code == 1
    assert outcome.line == ("te-dist train: rank 0 failed in step 7: loss all-reduce (group ranks [0, 1]) did not "
                            "finish within 3 s; not responding: rank 1 (stopped); results incomplete: this job wrote "
                            f"no checkpoint; logs {tmp_path / 'logs' / 'rank0.log'}")
    assert watch.after_exit(1) == outcome  # the same line when torchrun ends first


def test_after_torchrun_ends_by_itself(job, tmp_path):
    root, as_rank = job
    watch = _watch(root, tmp_path)
    assert watch.after_exit(0) == Outcome(0, None)
    killed = watch.after_exit(-9)
    assert killed.code == -9 and "without a rank reporting an error" in killed.line
    assert killed.line.endswith(f"logs {tmp_path / 'logs' / 'torchrun.log'}")
    _every_rank(as_rank, ("done", 3, 3, None))
    crashed = watch.after_exit(1)  # e.g. a rank aborted in its teardown after a complete run
    assert crashed.code == EXIT_COMPLETE_NOT_EXITED and "the run is complete (step 3/3, checkpoint none" in crashed.line


def test_the_first_failure_is_named_not_the_ones_it_set_off(job, tmp_path):
    root, as_rank = job
    as_rank(1)
    job_files.mark_failed("RuntimeError: injected failure on rank 1 at step 2", "step 2")
    as_rank(0)  # later: its collective failed because rank 1 closed its connections
    job_files.mark_failed("ConsensusError: recipe consensus failed on rank 0: Connection closed by peer", "step 2")
    line = _watch(root, tmp_path).after_exit(1).line
    assert line.startswith("te-dist train: rank 1 failed in step 2: RuntimeError: injected failure on rank 1 at "
                           "step 2 (rank 0 failed too); results incomplete"), line
    assert line.endswith(f"logs {tmp_path / 'logs' / 'rank1.log'}")
