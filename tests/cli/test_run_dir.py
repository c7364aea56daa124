"""What a run may do with its output directory: refuse, resume, overwrite; the lock; the metrics file."""

import json
import subprocess
import sys
import time

import pytest

from te_dist.train.config import ConfigError, JobConfig
from te_dist.train.manifest import CheckpointError
from te_dist.train.run_dir import RESUME_LATEST, open_run, plan_run
from te_dist.train.run_lock import RunLock, lock_holder

from conftest import REPO_ROOT


def _cfg(out) -> JobConfig:
    cfg = JobConfig()
    cfg.train.out_dir = str(out)
    return cfg


def test_an_out_that_holds_a_run_is_refused_unless_asked(tmp_path, fake_checkpoint):
    out = tmp_path / "out"
    fake_checkpoint(out, 2, run_id="old")
    fake_checkpoint(out, 4, run_id="old")
    with pytest.raises(ConfigError, match=r"holds another run \(checkpoints step_000002..step_000004\); pass --resume"):
        plan_run(_cfg(out))
    replaced = plan_run(_cfg(out), overwrite=True)
    assert replaced.replace and replaced.checkpoint is None and replaced.run_id != "old"
    resumed = plan_run(_cfg(out), resume=RESUME_LATEST)
    assert (resumed.in_place, resumed.run_id, resumed.step, resumed.replace) == (True, "old", 4, False)
    assert resumed.checkpoint == str(out / "checkpoints" / "step_000004")
    with pytest.raises(ConfigError, match="pass only one"):
        plan_run(_cfg(out), resume=RESUME_LATEST, overwrite=True)
    with pytest.raises(ConfigError, match="needs --resume"):
        plan_run(_cfg(out), skip_invalid=True)
    only_metrics = tmp_path / "metrics_only"
    only_metrics.mkdir()
    (only_metrics / "metrics.jsonl").write_text('{"run": "x", "step": 1}\n')
    with pytest.raises(ConfigError, match=r"holds another run \(metrics.jsonl\)"):
        plan_run(_cfg(only_metrics))


def test_resume_from_elsewhere_starts_a_new_run(tmp_path, fake_checkpoint):
    source = fake_checkpoint(tmp_path / "src", 6, run_id="parent", losses={5: 1.5, 6: 1.25, 7: 9.0})
    fork = plan_run(_cfg(tmp_path / "fresh"), resume=str(source))
    assert (fork.in_place, fork.step, fork.replace) == (False, 6, False) and fork.run_id != "parent"
    assert fork.history == {5: ("parent", 1.5), 6: ("parent", 1.25)}  # never beyond the resumed step
    assert any("train.out_dir" in note for note in fork.notes)  # the settings that differ are listed
    fake_checkpoint(tmp_path / "busy", 2, run_id="busy")
    with pytest.raises(ConfigError, match="starts a new run there: pass --overwrite"):
        plan_run(_cfg(tmp_path / "busy"), resume=str(source))
    assert plan_run(_cfg(tmp_path / "busy"), resume=str(source), overwrite=True).replace
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--resume .*empty: no checkpoint"):
        plan_run(_cfg(tmp_path / "fresh"), resume=str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="no such checkpoint or output directory"):
        plan_run(_cfg(tmp_path / "fresh"), resume=str(tmp_path / "typo"))
    started = plan_run(_cfg(tmp_path / "never_ran"), resume=RESUME_LATEST)
    assert started.checkpoint is None and "starting at step 1" in started.notes[0]


def test_a_bad_checkpoint_is_named_and_skipped_only_when_asked(tmp_path, fake_checkpoint):
    out = tmp_path / "out"
    fake_checkpoint(out, 2)
    bad = fake_checkpoint(out, 4)
    (bad / "__0_0.distcp").write_bytes(b"flipped")
    with pytest.raises(CheckpointError, match=r"step_000004/__0_0.distcp: 7 bytes, meta.json records"):
        plan_run(_cfg(out), resume=RESUME_LATEST)
    plan = plan_run(_cfg(out), resume=RESUME_LATEST, skip_invalid=True)
    assert plan.step == 2
    assert any("skipped step_000004" in n for n in plan.notes)
    assert any("(step_000004) are replaced as the run reaches them" in n for n in plan.notes)


def _hold_lock(out):
    code = (f"from te_dist.train.run_lock import RunLock; RunLock({str(out)!r}).acquire('holder'); "
            f"print('held', flush=True); import time; time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_refuses_a_second_run_and_a_dead_runs_lock_is_stale(tmp_path):
    out = tmp_path / "out"
    holder = _hold_lock(out)
    try:
        assert f"run holder (pid {holder.pid} on" in lock_holder(out)
        with pytest.raises(ConfigError, match=rf"in use by the live run holder \(pid {holder.pid} on"):
            plan_run(_cfg(out))
        with pytest.raises(ConfigError, match="in use by the live run holder"):
            RunLock(out).acquire("second")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert lock_holder(out) is None  # the kernel dropped the dead holder's lock
    lock = RunLock(out).acquire("third")
    assert lock.stale is not None and f"pid {holder.pid}" in lock.stale
    lock.release()
    again = RunLock(out).acquire("fourth")  # released cleanly: nothing stale
    assert again.stale is None
    again.release()


def test_resumed_run_keeps_its_own_metrics_up_to_the_step(tmp_path, fake_checkpoint, one_rank_runtime):
    out = tmp_path / "out"
    fake_checkpoint(out, 2, run_id="r1", losses={1: 4.0, 2: 3.0})
    rows = [{"run": "r1", "step": s, "loss": 5.0 - s, "lr": 0.1} for s in (1, 2, 3, 4)]
    lines = [json.dumps(r) for r in rows] + ['{"step": 1, "loss": 7.0}', '{"run": "r1", "step": 5, "lo']
    (out / "metrics.jsonl").write_text("\n".join(lines))
    (out / "checkpoints" / ".step_000004.partial").mkdir()  # a save that died
    run = open_run(_cfg(out), one_rank_runtime, resume=RESUME_LATEST)
    try:
        assert run.run_id == "r1" and run.plan.step == 2
        run.append_metrics({"step": 3, "loss": 0.5})
        got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert got == [rows[0], rows[1], {"run": "r1", "step": 3, "loss": 0.5}]
        assert not (out / "checkpoints" / ".step_000004.partial").exists()
        assert any("dropped 4 later line(s)" in n for n in run.plan.notes)
        with pytest.raises(ConfigError, match="in use by the live run r1"):  # the run holds --out while alive
            open_run(_cfg(out), one_rank_runtime, resume=RESUME_LATEST)
    finally:
        run.close()
    assert lock_holder(out) is None
