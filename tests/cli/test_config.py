"""Job config validation: every bad value names the key to change (no ranks are started)."""

from pathlib import Path

import pytest

from te_dist.recipe import Float8BlockScaling, Float8CurrentScaling
from te_dist.train.config import ConfigError, JobConfig, config_from_dict, load_config, resolve_recipe

CONFIGS = Path(__file__).resolve().parents[2] / "launchers" / "configs"


def test_defaults_are_valid_for_two_ranks():
    cfg = JobConfig().validate(world_size=2)
    assert cfg.layout(2) == (2, cfg.data.global_batch_size // 2)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = load_config(path)
    # The recipe section round-trips through Recipe.to_dict / from_dict.
    recipe = resolve_recipe(cfg.recipe)
    if recipe is not None:
        assert resolve_recipe(recipe.to_dict()) == recipe


def test_example_configs_select_their_recipes():
    assert resolve_recipe(load_config(CONFIGS / "tiny_cpu.yaml").recipe) == Float8CurrentScaling()
    assert resolve_recipe(load_config(CONFIGS / "deepseek_like.yaml").recipe) == Float8BlockScaling()


def test_overrides_win_over_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: {steps: 7}\nrecipe: current\n")
    cfg = load_config(path, overrides={"train.steps": 3, "recipe": "none", "parallel.ep": 1})
    assert (cfg.train.steps, cfg.recipe, cfg.parallel.ep) == (3, "none", 1)


@pytest.mark.parametrize(
    "data, match",
    [
        ({"model": {"hiden_size": 8}}, r"unknown key\(s\) \['hiden_size'\] in config section 'model'"),
        ({"modle": {}}, r"unknown top-level config key\(s\) \['modle'\]"),
        ({"model": {"num_heads": 3}}, r"model.hidden_size=128 is not divisible by model.num_heads=3"),
        ({"model": {"top_k": 9}}, r"model.top_k=9 exceeds model.num_experts=4"),
        ({"model": {"dtype": "float8"}}, r"model.dtype must be one of"),
        ({"model": {"num_layers": "two"}}, r"model.num_layers must be an int, got str 'two'"),
        ({"train": {"lr": "fast"}}, r"train.lr must be a number, got 'fast'"),
        ({"train": {"steps": 0}}, r"train.steps must be >= 1, got 0"),
        ({"recipe": "fp7"}, r"recipe must be one of"),
        ({"recipe": "block", "model": {"hidden_size": 64}}, r"model.hidden_size=64 is not a multiple of 128, which the Float8BlockScaling"),
        ({"recipe": "mxfp8", "model": {"ffn_hidden_size": 48}}, r"model.ffn_hidden_size=48 is not a multiple of 32"),
        ({"recipe": {"type": "Float8CurrentScaling", "fp8_format": "E2M1"}}, r"recipe: .*fp8_format must be one of"),
        ({"recipe": {"type": "Float8CurrentScaling", "fp8_format": "E9M9"}}, r"recipe: fp8_format: unknown format"),
        ({"recipe": {"type": "Nope"}}, r"unknown recipe type 'Nope'"),
    ],
)
def test_bad_values_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(data).validate()


def test_worker_argv_round_trips_the_flags():
    import argparse

    from te_dist.train.args import add_train_arguments, config_from_args, worker_argv

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    given = parser.parse_args(["--steps", "5", "--recipe", "delayed", "--ep", "1", "--no-checkpoint", "--lr", "0.002"])
    again = parser.parse_args(worker_argv(given))
    assert vars(again) == vars(given)
    cfg = config_from_args(again)
    assert (cfg.train.steps, cfg.recipe, cfg.parallel.ep, cfg.train.checkpoint, cfg.train.lr) == (5, "delayed", 1, False, 0.002)


def test_yaml_float_without_dot_is_accepted(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train: {lr: 3e-3}\n")  # YAML 1.1 reads this as a string
    assert load_config(path).train.lr == pytest.approx(3e-3)


@pytest.mark.parametrize(
    "data, world, match",
    [
        ({"parallel": {"ep": 3}}, 2, r"parallel.ep=3 does not divide the number of ranks \(2\)"),
        ({"model": {"num_experts": 3}, "parallel": {"ep": 2}}, 2, r"model.num_experts=3 is not divisible by parallel.ep=2"),
        ({"data": {"global_batch_size": 6}}, 4, r"data.global_batch_size=6 is not divisible by the number of ranks \(4\)"),
    ],
)
def test_layout_errors(data, world, match):
    cfg = config_from_dict(data).validate()
    with pytest.raises(ConfigError, match=match):
        cfg.validate(world_size=world)


def test_transport_is_checked_against_the_layers_choices():
    from te_dist.moe import TRANSPORTS
    from te_dist.train import config as config_module

    assert config_module.TRANSPORTS == TRANSPORTS
    assert config_from_dict({"parallel": {"transport": "peer"}}).validate().parallel.transport == "peer"
    with pytest.raises(ConfigError, match=r"parallel.transport must be one of \['auto', 'all_to_all', 'peer'\], got 'nccl'"):
        config_from_dict({"parallel": {"transport": "nccl"}}).validate()


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(listy)


def test_autotune_switch_is_a_checked_bool():
    assert config_from_dict({"train": {"autotune": False}}).validate().train.autotune is False
    assert JobConfig().train.autotune is True  # measured grouped-GEMM choices are on by default
    with pytest.raises(ConfigError, match="train.autotune must be true or false"):
        config_from_dict({"train": {"autotune": "yes"}}).validate()


def test_model_dtype_auto_is_bf16_on_gpus_and_fp32_on_cpu():
    """The default dtype: bfloat16 where the native FP8 expert kernels run (they take bf16), float32 on CPU;
    an explicit dtype wins everywhere, and the model is built in what it resolves to."""
    import torch

    from te_dist.train.config import ModelConfig, model_dtype
    from te_dist.train.model import build_model

    assert JobConfig().model.dtype == "auto"
    assert model_dtype("auto", "cuda") == "bfloat16" and model_dtype("auto", "cpu") == "float32"
    assert model_dtype("float16", "cuda") == "float16" and model_dtype("bfloat16", "cpu") == "bfloat16"
    assert build_model(ModelConfig(num_layers=1), seed=0).head.weight.dtype == torch.float32
    assert build_model(ModelConfig(num_layers=1, dtype="bfloat16"), seed=0).head.weight.dtype == torch.bfloat16
