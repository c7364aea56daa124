"""Run directories without ``--out``: a new one per run (distinct even within one second), ``latest``."""

import os
import threading

import pytest

from te_dist.train.config import ConfigError, JobConfig
from te_dist.train.run_dir import RESUME_LATEST, open_run
from te_dist.train.run_dirs import (LATEST, choose_out_dir, latest_run_dir, new_run_dir, point_latest,
                                    run_dir_names)

NOON = 1_800_000_000.0  # one fixed second: every directory below is "started" in it


def test_runs_started_in_the_same_second_get_distinct_directories(tmp_path):
    made = [new_run_dir(tmp_path / "root", now=NOON) for _ in range(3)]
    stamp = made[0].name
    assert [p.name for p in made] == [stamp, f"{stamp}-1", f"{stamp}-2"]
    assert all(p.is_dir() and not any(p.iterdir()) for p in made)
    assert run_dir_names(tmp_path / "root") == made


def test_concurrent_runs_never_share_a_directory(tmp_path):
    root, num_runs = tmp_path / "root", 12
    barrier, made, errors = threading.Barrier(num_runs), [], []

    def start():
        try:
            barrier.wait(timeout=30)
            made.append(new_run_dir(root, now=NOON))
        except Exception as exc:  # reported below: a thread's exception does not fail the test by itself
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(num_runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(made) == num_runs and len(set(made)) == num_runs
    assert sorted(made) == sorted(run_dir_names(root))


def test_latest_names_the_newest_run(tmp_path):
    root = tmp_path / "root"
    assert latest_run_dir(root) is None
    first, second = new_run_dir(root, now=NOON), new_run_dir(root, now=NOON + 60)
    assert latest_run_dir(root) == second  # no pointer yet: the newest by name
    point_latest(root, first)
    assert (root / LATEST).is_symlink() and os.readlink(root / LATEST) == first.name
    assert latest_run_dir(root) == first  # the pointer wins over the names
    point_latest(root, second)
    assert latest_run_dir(root) == second
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # no temporary left
    second.rmdir()
    assert latest_run_dir(root) == first  # a pointer to a removed run: the newest that is left


def test_suffixes_order_by_number_not_by_text(tmp_path):
    root = tmp_path / "root"
    made = [new_run_dir(root, now=NOON) for _ in range(12)]
    (root / "notes").mkdir()  # not a run directory
    assert run_dir_names(root) == made and latest_run_dir(root) == made[-1]


def test_latest_is_a_file_where_symlinks_fail(tmp_path, monkeypatch):
    root = tmp_path / "root"
    run = new_run_dir(root, now=NOON)
    new_run_dir(root, now=NOON + 60)

    def no_symlinks(*args, **kwargs):
        raise OSError("symlinks are not supported on this file system")

    monkeypatch.setattr(os, "symlink", no_symlinks)
    point_latest(root, run)
    assert not (root / LATEST).is_symlink() and (root / LATEST).read_text().strip() == run.name
    assert latest_run_dir(root) == run


def test_choose_out_dir(tmp_path):
    root = tmp_path / "root"
    given = choose_out_dir("mine", resume=RESUME_LATEST, root=root)
    assert (given.path.name, given.created) == ("mine", False) and not root.exists()  # --out: as given
    fresh = choose_out_dir(None, resume=RESUME_LATEST, root=root)  # nothing to resume: a new run
    assert fresh.created and fresh.path.parent == root and "no run under" in fresh.note
    point_latest(root, fresh.path)
    again = choose_out_dir(None, resume=RESUME_LATEST, root=root)
    assert (again.path, again.created) == (fresh.path, False) and "continues the newest run" in again.note
    other = choose_out_dir(None, resume="some/step_000002", root=root)  # --resume DIR: a new run from it
    assert other.created and other.path != fresh.path
    with pytest.raises(ConfigError, match="--overwrite replaces the run that --out holds: pass --out DIR"):
        choose_out_dir(None, overwrite=True, root=root)


def test_a_run_without_out_under_plain_torchrun(tmp_path, monkeypatch, one_rank_runtime):
    """Rank 0 chooses the directory when no ``te-dist`` parent did (launchers/train.py), and every rank
    learns it; ``--resume`` then continues that run."""
    monkeypatch.chdir(tmp_path)
    cfg = JobConfig()
    assert cfg.train.out_dir is None
    run = open_run(cfg, one_rank_runtime)
    try:
        assert run.out_dir.parent.name == "te_dist_out" and run.out_dir.is_dir()
        assert latest_run_dir("te_dist_out") == run.out_dir
        assert any(f"run directory {run.out_dir} (new" in note for note in run.plan.notes)
        run.append_metrics({"step": 1, "loss": 1.0})
    finally:
        run.close()
    resumed = open_run(JobConfig(), one_rank_runtime, resume=RESUME_LATEST)
    try:
        assert resumed.out_dir == run.out_dir and resumed.plan.checkpoint is None
    finally:
        resumed.close()
    with pytest.raises(ConfigError, match="--overwrite replaces the run that --out holds"):
        open_run(JobConfig(), one_rank_runtime, overwrite=True)
