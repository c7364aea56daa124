"""`te-dist train` under signals and stuck ranks, as an operator would see it (real torchrun, gloo).

Every process the command starts inherits a unique ``TE_DIST_TEST_TAG``; the tests find the job's
processes by it (torchrun puts each rank in a session of its own, so process groups miss them)
and check that none is left. A test that fails still kills all of them.

A rank stopped (SIGSTOP) at start-up, mid-step, in a checkpoint save and after the last step ends
the job within that phase's deadline + 10 s, with one line on the terminal naming the phase, the
rank and the deadline, and nothing half written. Small deadlines keep the tests fast.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from te_dist.train.processes import kill_tagged, process_state, tagged_processes

pytestmark = pytest.mark.multiprocess

REPO_ROOT = Path(__file__).resolve().parents[2]
TAG = "TE_DIST_TEST_TAG"
STARTUP_S = 240  # a loaded shared CPU machine can take minutes to import torch in three processes
PHASE_TEST_S = 2 * STARTUP_S + 120  # each stuck-rank test's own limit: a hang fails it, never the whole run


class Job:
    """``te-dist train ...`` started in the background, its output collected line by line."""

    def __init__(self, cwd, *args):
        self.tag = uuid.uuid4().hex
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env["OMP_NUM_THREADS"] = "1"
        env[TAG] = self.tag
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "te_dist.cli", "train", *map(str, args)], cwd=str(cwd), env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float = STARTUP_S) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no line with {text!r} (exit code {self.proc.poll()}):\n{self.output[-6000:]}")
            time.sleep(0.05)

    def processes(self) -> list:
        """Live processes of the job, the launcher (``te-dist`` itself) included."""
        return tagged_processes(TAG, self.tag)

    def seconds_until_only_launcher_left(self, timeout: float) -> float:
        """How long torchrun and the ranks took to be gone (the launcher's own interpreter teardown,
        slow on a loaded machine, is not counted)."""
        start = time.monotonic()
        while set(self.processes()) - {self.proc.pid}:
            if time.monotonic() - start > timeout:
                raise AssertionError(f"job processes {self.processes()} still alive after {timeout} s:\n{self.output}")
            time.sleep(0.05)
        return time.monotonic() - start

    def rank_pid(self, rank: int, timeout: float = 0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            for pid in self.processes():
                try:
                    if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                        return pid
                except OSError:  # exited meanwhile
                    continue
            if time.monotonic() >= deadline or self.proc.poll() is not None:
                raise AssertionError(f"rank {rank} not found among {self.processes()}:\n{self.output[-6000:]}")
            time.sleep(0.02)

    def wait_stopped(self, rank: int, timeout: float = STARTUP_S) -> None:
        """Until rank ``rank`` stopped itself (--fail-with stop)."""
        pid = self.rank_pid(rank, timeout=timeout)
        deadline = time.monotonic() + timeout
        while process_state(pid) != "stopped":
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"rank {rank} never stopped (exit code {self.proc.poll()}):\n{self.output}")
            time.sleep(0.02)

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"te-dist did not exit within {timeout} s:\n{self.output[-6000:]}") from None
        self._reader.join(timeout=5)
        return code

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        kill_tagged(TAG, self.tag)


@pytest.fixture
def start(tmp_path):
    jobs = []

    def run(*args) -> Job:
        jobs.append(Job(tmp_path, *args))
        return jobs[-1]

    yield run
    for job in jobs:
        job.cleanup()


def _losses(out_dir) -> dict:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def _after(lines: list, marker: str) -> list:
    """The lines printed from the first one containing ``marker`` on."""
    start = next(i for i, line in enumerate(lines) if marker in line)
    return lines[start:]


def _assert_no_noise(text: str) -> None:
    for noise in ("Traceback", "KeyboardInterrupt", "SignalException", "ChildFailedError", "torch.distributed.elastic"):
        assert noise not in text, text


@pytest.fixture
def constant_lr(tmp_path):
    """A config whose learning rate does not depend on ``--steps``: a run stopped early and a shorter
    uninterrupted run then follow the same trajectory."""
    path = tmp_path / "constant_lr.yaml"
    path.write_text("train:\n  warmup_steps: 0\n  min_lr_ratio: 1.0\n  ckpt_every: 0\n  log_every: 1\n")
    return path


def test_sigint_to_the_launcher_stops_every_process(start, constant_lr):
    job = start("--config", constant_lr, "--steps", 100000, "--recipe", "none", "--out", "run")
    job.wait_for("step     2/")
    before = job.processes()
    assert len(before) >= 3, before  # torchrun and two ranks
    os.kill(job.proc.pid, signal.SIGINT)
    assert job.seconds_until_only_launcher_left(timeout=60) < 10, job.output
    assert job.wait(timeout=60) == 130, job.output
    assert job.processes() == [], job.output
    tail = _after(job.lines, "stopped by SIGINT")
    assert [line for line in tail if not line.startswith("step ")] == [tail[0]], job.output
    assert "no checkpoint written" in tail[0]
    _assert_no_noise(job.output)


def test_sigterm_saves_a_checkpoint_and_resume_is_bit_identical(start, constant_lr, tmp_path):
    common = ("--config", constant_lr, "--recipe", "delayed")  # stateful recipe: amax histories must come back
    job = start(*common, "--steps", 100000, "--out", "stopped")
    job.wait_for("step     2/")
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.seconds_until_only_launcher_left(timeout=60) < 10, job.output
    assert job.wait(timeout=60) == 143, job.output
    assert job.processes() == [], job.output
    line = _after(job.lines, "stopped by SIGTERM")[0]
    _assert_no_noise(job.output)
    stopped_at = int(line.split("after step ")[1].split("/")[0])
    assert f"checkpoint stopped/checkpoints/step_{stopped_at:06d}" in line, line
    assert (tmp_path / "stopped" / "checkpoints" / f"step_{stopped_at:06d}" / "meta.json").is_file()

    total = stopped_at + 2
    straight = start(*common, "--steps", total, "--out", "straight")
    resumed = start(*common, "--steps", total, "--out", "stopped", "--resume", "stopped")
    assert straight.wait(timeout=STARTUP_S) == 0, straight.output
    assert resumed.wait(timeout=STARTUP_S) == 0, resumed.output
    assert f"resumed from stopped/checkpoints/step_{stopped_at:06d}" in resumed.output
    expected, got = _losses(tmp_path / "straight"), _losses(tmp_path / "stopped")
    assert sorted(got) == list(range(1, total + 1))
    assert got == expected  # exact float equality, every step, before and after the stop


def _config(tmp_path, **train) -> Path:
    path = tmp_path / "deadlines.yaml"
    path.write_text("train:\n" + "".join(f"  {key}: {value}\n" for key, value in train.items()))
    return path


def _outcome(job: Job) -> str:
    """The launcher's one line (every line after the rank output that starts with 'te-dist train:')."""
    lines = [line for line in job.lines if line.startswith("te-dist train:")]
    assert len(lines) == 1, job.output
    _assert_no_noise(job.output)  # tracebacks went to the rank logs
    return lines[0]


@pytest.mark.timeout(PHASE_TEST_S)
def test_a_rank_stopped_at_start_up_ends_the_job(start, tmp_path):
    deadline_s = 15
    job = start("--config", _config(tmp_path, startup_timeout_s=deadline_s), "--steps", 4, "--out", "run")
    os.kill(job.rank_pid(1, timeout=STARTUP_S), signal.SIGSTOP)  # as soon as it exists: long before it joins
    assert job.seconds_until_only_launcher_left(timeout=deadline_s + 60) < deadline_s + 10, job.output
    assert job.wait(timeout=60) == 1, job.output
    assert job.processes() == [], job.output  # the stopped rank too
    line = _outcome(job)
    assert line.startswith(f"te-dist train: start-up did not finish within {deadline_s} s (train.startup_timeout_s): "
                           f"rank 1 (stopped) had not joined the job's process group; the job was killed"), line
    assert line.endswith("logs run/logs/"), line
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(PHASE_TEST_S)
def test_a_rank_stopped_mid_step_fails_the_job_on_every_live_rank(start, tmp_path):
    timeout_s = 3
    job = start("--config", _config(tmp_path, collective_timeout_s=timeout_s, log_every=1), "--steps", 100000,
                "--recipe", "none", "--out", "run")
    job.wait_for("step     2/")
    os.kill(job.rank_pid(1), signal.SIGSTOP)
    assert job.seconds_until_only_launcher_left(timeout=timeout_s + 60) < timeout_s + 10, job.output
    assert job.wait(timeout=60) == 1, job.output
    assert job.processes() == [], job.output  # the stopped rank too
    line = _outcome(job)
    assert line.startswith("te-dist train: rank 0 failed in step "), line
    assert f"did not finish within {timeout_s} s" in line and "rank(s) [1] did not respond" in line, line
    assert "all_to_all" in line or "all-reduce" in line, line  # the operation is named
    assert "not responding: rank 1 (stopped)" in line and line.endswith("logs run/logs/rank0.log"), line
    assert "te-dist train: error: rank 0:" in (tmp_path / "run" / "logs" / "rank0.log").read_text()


@pytest.mark.timeout(PHASE_TEST_S)
def test_a_rank_stopped_in_a_checkpoint_save_leaves_no_half_written_checkpoint(start, tmp_path):
    from te_dist.train.manifest import list_checkpoints, verify_checkpoint

    deadline_s = 8
    job = start("--config", _config(tmp_path, checkpoint_timeout_s=deadline_s), "--steps", 6, "--ckpt-every", 2,
                "--recipe", "none", "--out", "run", "--fail-rank", 1, "--fail-with", "stop", "--fail-at", "save",
                "--fail-step", 4)
    job.wait_stopped(1)
    assert job.seconds_until_only_launcher_left(timeout=deadline_s + 60) < deadline_s + 10, job.output
    assert job.wait(timeout=60) == 1, job.output
    assert job.processes() == [], job.output
    line = _outcome(job)
    assert line.startswith(f"te-dist train: the checkpoint save of step 4 did not finish within {deadline_s} s "
                           f"(train.checkpoint_timeout_s): rank 1 (stopped) had not finished it; the job was killed; "
                           f"step 4 has no checkpoint"), line
    assert "the newest checkpoint this job wrote is step 2" in line, line
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step_000002"]
    assert verify_checkpoint(checkpoints / "step_000002")["step"] == 2  # whole
    assert sorted(_losses(tmp_path / "run")) == [1, 2, 3, 4]


@pytest.mark.timeout(PHASE_TEST_S)
def test_a_rank_stopped_after_the_last_step_ends_a_complete_run(start, tmp_path):
    deadline_s = 5
    config = _config(tmp_path, exit_grace_s=deadline_s)
    job = start("--config", config, "--steps", 3, "--recipe", "none", "--out", "run", "--fail-rank", 1,
                "--fail-with", "stop", "--fail-at", "exit")
    job.wait_stopped(1)
    assert job.seconds_until_only_launcher_left(timeout=deadline_s + 60) < deadline_s + 10, job.output
    assert job.wait(timeout=60) == 3, job.output  # complete, but a rank did not exit
    assert job.processes() == [], job.output
    line = _outcome(job)
    assert "1 (stopped) did not exit within 5 s of rank 0 finishing the run (train.exit_grace_s)" in line, line
    assert "the run is complete (step 3/3, checkpoint run/checkpoints/step_000003): exit code 3" in line, line
    assert sorted(_losses(tmp_path / "run")) == [1, 2, 3]
    again = start("--config", config, "--steps", 3, "--recipe", "none", "--out", "run", "--resume")
    assert again.wait(timeout=STARTUP_S) == 0, again.output
    assert "[te-dist] the run is complete: checkpoint run/checkpoints/step_000003 is at step 3" in again.output
