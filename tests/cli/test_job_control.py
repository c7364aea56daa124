"""The launcher's pieces without a job: finding processes by their tag, the job files, stop votes."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from te_dist.train import job_files
from te_dist.train.job_watch import JobLimits
from te_dist.train.launch import launch
from te_dist.train.processes import can_scan, is_tagged, kill_tagged, tagged_processes
from te_dist.train.stop import StopRequest

needs_proc = pytest.mark.skipif(not can_scan(), reason="finding processes by environment needs Linux /proc")


@needs_proc
def test_tagged_processes_are_found_in_their_own_sessions_and_killed():
    tag = uuid.uuid4().hex
    env = dict(os.environ, TE_DIST_TEST_TAG=tag)
    # A parent that starts a child in a session of its own and exits: the child is orphaned.
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
              "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(tagged_processes("TE_DIST_TEST_TAG", tag)) < 2:
            assert time.monotonic() < deadline, "the tagged child never appeared"
            time.sleep(0.05)
        found = tagged_processes("TE_DIST_TEST_TAG", tag)
        assert parent.pid in found and len(found) == 2
        assert is_tagged(parent.pid, "TE_DIST_TEST_TAG", tag)
        assert not is_tagged(parent.pid, "TE_DIST_TEST_TAG", "another-job")
        assert kill_tagged("TE_DIST_TEST_TAG", tag) == []
        assert tagged_processes("TE_DIST_TEST_TAG", tag) == []
    finally:
        kill_tagged("TE_DIST_TEST_TAG", tag)
        parent.wait()


def test_job_files_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(job_files.JOB_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    job_files.mark_ready()
    job_files.mark_failed("rank 3: token combine (all_to_all) did not finish\nsecond line dropped", "step 7")
    assert job_files.ready_pids(tmp_path) == {3: os.getpid()}
    failure = job_files.failures(tmp_path)[3]
    assert failure.pop("at") <= time.time()
    assert failure == {"error": "rank 3: token combine (all_to_all) did not finish", "phase": "step 7"}
    phase = job_files.RankPhase()
    assert job_files.progress(tmp_path) == {} and phase.where == "start-up"
    phase.started()
    assert job_files.progress(tmp_path)[3]["stage"] == "started"
    phase.step(4)
    assert phase.where == "step 4" and job_files.progress(tmp_path)[3]["stage"] == "started"  # steps: memory only
    phase.saving(4)
    assert job_files.progress(tmp_path)[3] == {"stage": "saving", "step": 4, "saved": None}
    assert phase.where == "the checkpoint save of step 4"
    phase.saved(4)
    phase.done(6, 6, "out/checkpoints/step_000006")
    assert job_files.progress(tmp_path)[3] == {"stage": "done", "step": 6, "steps": 6, "saved": 4,
                                               "checkpoint": "out/checkpoints/step_000006"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_job_files_are_not_written_outside_a_job(tmp_path, monkeypatch):
    monkeypatch.delenv(job_files.JOB_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    job_files.mark_ready()
    job_files.mark_failed("boom")
    assert list(tmp_path.iterdir()) == []


def test_stop_votes_and_agreement():
    stop = StopRequest()
    assert stop.votes() == [0.0, 0.0]
    stop._record(signal.SIGINT, None)
    assert stop.votes() == [1.0, 0.0]
    stop._record(signal.SIGTERM, None)
    assert stop.votes() == [1.0, 1.0]
    assert StopRequest.agreed(0.0, 0.0) is None
    assert StopRequest.agreed(2.0, 0.0) == signal.SIGINT
    assert StopRequest.agreed(1.0, 1.0) == signal.SIGTERM  # a checkpoint was asked for: it wins


@pytest.mark.parametrize("field", ["startup_s", "checkpoint_s", "exit_grace_s", "stop_grace_s"])
@pytest.mark.parametrize("seconds", [0, -1.0, "8", True])
def test_job_limits_reject_a_bad_deadline(field, seconds):
    with pytest.raises(ValueError, match=f"JobLimits.{field} must be a number of seconds > 0, got {seconds!r}"):
        JobLimits(**{field: seconds})
    with pytest.raises(TypeError, match="limits must be a JobLimits"):
        launch(2, [], limits={field: 1.0})
