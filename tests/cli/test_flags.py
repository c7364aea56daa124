"""`te-dist train` flags: every config field as --SECTION.KEY, validated like the YAML (no ranks started)."""

import os
import subprocess
import sys

import pytest
import yaml

from te_dist.cli import build_parser, main
from te_dist.train.args import config_from_args, worker_argv
from te_dist.train.config import ConfigError, load_config
from te_dist.train.resolved import resolved_config

from conftest import REPO_ROOT


def _parse(*argv):
    parser = build_parser()
    ns, extras = parser.parse_known_args(["train", *map(str, argv)])
    assert extras == []
    return ns


def test_nested_fields_override_file_and_defaults(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: {num_experts: 4, top_k: 1}\ntrain: {steps: 7}\nrecipe: delayed\n")
    ns = _parse("--config", path, "--model.num_experts", 8, "--train.steps", 100, "--data.seq_len", 16,
                "--model.expert_bias", "true", "--train.lr", "3e-3", "--recipe.amax_history_len", 16)
    cfg = config_from_args(ns)
    assert (cfg.model.num_experts, cfg.model.top_k, cfg.train.steps, cfg.data.seq_len) == (8, 1, 100, 16)
    assert cfg.model.expert_bias is True and cfg.train.lr == 3e-3
    assert cfg.recipe == {"type": "DelayedScaling", "margin": 0, "fp8_format": "HYBRID", "amax_history_len": 16,
                          "amax_compute_algo": "max", "reduce_amax": True, "backward_override": None}


def test_short_flags_are_aliases_and_the_last_one_wins():
    cfg = config_from_args(_parse("--steps", 5, "--train.steps", 9, "--ep", 2, "--parallel.ep", "null", "--no-checkpoint"))
    assert (cfg.train.steps, cfg.parallel.ep, cfg.train.checkpoint) == (9, None, False)
    cfg = config_from_args(_parse("--train.steps", 9, "--steps", 5))
    assert cfg.train.steps == 5


def test_worker_argv_round_trips_dotted_flags_and_nulls():
    given = _parse("--model.num_experts", 8, "--parallel.ep", "null", "--recipe", "block",
                   "--recipe.use_power_2_scales", "false", "--lr", 0.002, "--no-checkpoint", "--config", "x.yaml")
    again = _parse(*worker_argv(given))
    assert vars(again) == vars(given)
    assert again.__dict__["parallel.ep"] is None and again.__dict__["recipe.use_power_2_scales"] is False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.num_expert", "8"], "unknown config key --model.num_expert (did you mean --model.num_experts"),
        (["--train.stpes=3"], "unknown config key --train.stpes (did you mean --train.steps"),
        (["--modle.top_k", "1"], "unknown config key --modle.top_k (did you mean --model.top_k"),
        (["--recipe.fp8_fromat", "E4M3"], "(did you mean --recipe.fp8_format"),
        (["--stepz", "3"], "unknown flag --stepz (did you mean --steps"),
        (["--model.num_layers", "two"], "argument --model.num_layers: expected an int, got 'two'"),
        (["--model.expert_bias", "maybe"], "expected true or false, got 'maybe'"),
    ],
)
def test_unknown_or_malformed_flags_exit_2_naming_the_closest(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.top_k", 9], "model.top_k=9 exceeds model.num_experts=4"),
        (["--model.dtype", "float8"], "model.dtype must be one of"),
        (["--train.log", "wandb"], "train.log must be one of ['jsonl', 'tensorboard'], got 'wandb'"),
        (["--recipe", "current", "--recipe.margin", 1],
         "recipe.margin is not a setting of Float8CurrentScaling; its settings are"),
        (["--recipe", "none", "--recipe.margin", 1], "recipe.margin was given but the recipe is 'none'"),
        (["--recipe", "current", "--recipe.fp8_format", "E2M1"], "fp8_format must be one of"),
    ],
)
def test_bad_values_from_flags_fail_like_the_yaml(argv, message, capsys):
    assert main(["train", "--print-config", *map(str, argv)]) == 2
    assert message in capsys.readouterr().err


def test_yaml_unknown_key_names_the_closest(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("train:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['stpes'\] in config section 'train' \(did you mean 'steps'\?\)"):
        load_config(path)


def test_print_config_is_the_resolved_config_and_loads_back(tmp_path, capsys):
    assert main(["train", "--print-config", "--nproc", "2", "--model.num_experts", "8", "--recipe", "block",
                 "--steps", "11"]) == 0
    text = capsys.readouterr().out
    printed = yaml.safe_load(text)
    assert printed["model"]["num_experts"] == 8 and printed["train"]["steps"] == 11
    assert printed["recipe"]["type"] == "Float8BlockScaling"  # the short name, expanded
    assert printed["provenance"]["world_size"] == 2 and printed["provenance"]["te_dist"]
    (tmp_path / "job.yaml").write_text(text)
    again = resolved_config(load_config(tmp_path / "job.yaml"), world_size=2)
    assert again == printed  # a printed (or saved) config is itself a valid --config


def test_help_version_and_print_config_do_not_import_torch():
    code = (
        "import sys, contextlib, io\n"
        "from te_dist.cli import main\n"
        "for argv in (['--help'], ['--version'], ['train', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try: main(argv)\n"
        "        except SystemExit as e: assert e.code == 0, (argv, e.code)\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    assert main(['train', '--print-config', '--device', 'cpu']) == 0\n"
        "assert 'model:' in out.getvalue()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bare_resume_means_the_run_dir_latest_and_round_trips():
    from te_dist.train import args, run_dir

    assert args.RESUME_LATEST is run_dir.RESUME_LATEST
    given = _parse("--resume", "--overwrite", "--keep-last", 2)
    assert given.resume is run_dir.RESUME_LATEST and given.__dict__["train.keep_last"] == 2
    assert vars(_parse(*worker_argv(given))) == vars(given)


def test_fault_flags_reach_the_workers_and_name_a_fault():
    from te_dist.train.args import fault_from_args
    from te_dist.train.faults import FaultInjection

    assert fault_from_args(_parse()) is None
    assert fault_from_args(_parse("--fail-rank", 1, "--fail-step", 2)) == FaultInjection(rank=1, step=2)
    given = _parse("--fail-rank", 1, "--fail-with", "stop", "--fail-at", "save", "--fail-step", 4,
                   "--out", "run")
    assert vars(_parse(*worker_argv(given))) == vars(given)
    assert fault_from_args(given) == FaultInjection(rank=1, step=4, action="stop", point="save")
    with pytest.raises(ValueError, match="FaultInjection.point must be one of"):
        FaultInjection(rank=0, point="teardown")
    with pytest.raises(RuntimeError, match="injected failure on rank 0 at the save of step 3"):
        FaultInjection(rank=0, step=3, point="save").at(0, "save", 3)
    FaultInjection(rank=0, step=3, point="save").at(1, "save", 3)  # another rank: nothing happens
    FaultInjection(rank=0, step=3, point="save").at(0, "step", 3)  # another point: nothing happens
