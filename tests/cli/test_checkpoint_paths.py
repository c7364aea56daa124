"""Which checkpoint `--resume` picks, and which it refuses (no ranks needed)."""

import json
from dataclasses import asdict

import pytest

from te_dist.train.checkpoint import check_compatible, checkpoint_dir, find_checkpoint
from te_dist.train.config import ConfigError, ModelConfig


def _fake(out, step, *, complete=True, **model):
    path = checkpoint_dir(out, step)
    path.mkdir(parents=True)
    if complete:
        (path / "meta.json").write_text(json.dumps({"step": step, "model": asdict(ModelConfig(**model))}))
    return path


def test_newest_complete_checkpoint_wins(tmp_path):
    _fake(tmp_path, 10)
    newest = _fake(tmp_path, 20)
    _fake(tmp_path, 30, complete=False)  # a save that was interrupted: no meta.json
    assert find_checkpoint(tmp_path) == newest
    assert find_checkpoint(tmp_path / "checkpoints") == newest
    assert find_checkpoint(checkpoint_dir(tmp_path, 10)) == checkpoint_dir(tmp_path, 10)


def test_no_checkpoint_is_a_clear_error(tmp_path):
    _fake(tmp_path, 5, complete=False)
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        find_checkpoint(tmp_path)


def test_model_shape_must_match(tmp_path):
    path = _fake(tmp_path, 5, num_experts=8)
    assert check_compatible(path, asdict(ModelConfig(num_experts=8, top_k=1)))["step"] == 5  # top_k may change
    with pytest.raises(ConfigError, match="model.num_experts: checkpoint 8 vs config 4"):
        check_compatible(path, asdict(ModelConfig()))
