"""The resolved config: what is printed at start, saved as config.yaml and kept in checkpoints."""

import yaml

from te_dist.train.config import JobConfig, config_from_dict, load_config
from te_dist.train.resolved import resolved_config, summary_lines, write_config_yaml


def test_resolved_config_fills_defaults_expands_the_recipe_and_records_versions():
    cfg = config_from_dict({"model": {"num_experts": 8}, "recipe": "delayed"}).validate()
    resolved = resolved_config(cfg, world_size=4)
    assert resolved["model"]["num_experts"] == 8 and resolved["model"]["hidden_size"] == 128
    assert resolved["recipe"]["type"] == "DelayedScaling" and resolved["recipe"]["amax_history_len"] == 1024
    prov = resolved["provenance"]
    assert prov["world_size"] == 4 and prov["te_dist"] and prov["torch"]
    assert set(prov) == {"te_dist", "torch", "git", "world_size"}
    assert resolved_config(config_from_dict({"recipe": "none"})).get("recipe") == "none"


def test_config_yaml_round_trips(tmp_path):
    cfg = config_from_dict({"train": {"steps": 9, "lr": 3e-3}, "parallel": {"ep": 1}}).validate()
    resolved = resolved_config(cfg, world_size=2)
    path = write_config_yaml(tmp_path, resolved)
    assert path.name == "config.yaml" and not list(tmp_path.glob(".*tmp"))
    assert yaml.safe_load(path.read_text()) == resolved
    assert resolved_config(load_config(path), world_size=2) == resolved


def test_summary_lines_read_like_the_yaml():
    lines = summary_lines(resolved_config(JobConfig(), world_size=2))
    assert lines[0].startswith("[te-dist] config model: vocab_size=64 hidden_size=128")
    assert any(line.startswith("[te-dist] config parallel: ep=null") for line in lines)
    assert any(line.startswith("[te-dist] config provenance: te_dist=") for line in lines)
