"""Which checkpoint `--resume` picks, and which it refuses (no ranks needed: small stand-in files)."""

import json
from dataclasses import asdict

import pytest

from te_dist.train.checkpoint import check_compatible, checkpoint_dir, find_checkpoint, prune_checkpoints, remove_stale
from te_dist.train.config import ConfigError, ModelConfig
from te_dist.train.manifest import CheckpointError, select_checkpoint


def test_newest_whole_checkpoint_wins(tmp_path, fake_checkpoint):
    fake_checkpoint(tmp_path, 10)
    newest = fake_checkpoint(tmp_path, 20)
    (tmp_path / "checkpoints" / ".step_000030.partial").mkdir()  # a save that was interrupted
    assert find_checkpoint(tmp_path) == newest
    assert find_checkpoint(tmp_path / "checkpoints") == newest
    assert find_checkpoint(checkpoint_dir(tmp_path, 10)) == checkpoint_dir(tmp_path, 10)
    assert remove_stale(tmp_path / "checkpoints") == [".step_000030.partial"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000010", "step_000020"]


def test_no_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="no checkpoint"):
        find_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint or output directory"):
        find_checkpoint(tmp_path / "elsewhere")


def test_step_directory_without_manifest_is_refused(tmp_path, fake_checkpoint):
    """Saves rename a directory into place only after meta.json: one without it was damaged."""
    fake_checkpoint(tmp_path, 10)
    broken = fake_checkpoint(tmp_path, 20)
    (broken / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=r"step_000020/meta.json: missing"):
        find_checkpoint(tmp_path)
    assert find_checkpoint(tmp_path, skip_invalid=True) == checkpoint_dir(tmp_path, 10)


def test_checkpoint_without_checksums_is_refused(tmp_path, fake_checkpoint):
    path = fake_checkpoint(tmp_path, 5)
    meta = json.loads((path / "meta.json").read_text())
    legacy = {k: v for k, v in meta.items() if k not in ("format", "files", "meta_sha256")}
    (path / "meta.json").write_text(json.dumps(legacy))
    with pytest.raises(CheckpointError, match="format None, expected 2"):
        select_checkpoint(path)


def test_model_shape_must_match(tmp_path, fake_checkpoint):
    path = fake_checkpoint(tmp_path, 5, num_experts=8)
    assert check_compatible(path, asdict(ModelConfig(num_experts=8, top_k=1)))["step"] == 5  # top_k may change
    with pytest.raises(ConfigError, match="model.num_experts: checkpoint 8 vs config 4"):
        check_compatible(path, asdict(ModelConfig()))


def test_keep_last_spares_checkpoints_after_the_current_step(tmp_path, fake_checkpoint):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    # A run resumed from step 4 has just saved step 6 again; step 8 belongs to the attempt it replaces.
    assert [p.name for p in prune_checkpoints(tmp_path / "checkpoints", 1, newest=6)] == ["step_000002", "step_000004"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000006", "step_000008"]
    assert prune_checkpoints(tmp_path / "checkpoints", 0, newest=8) == []
