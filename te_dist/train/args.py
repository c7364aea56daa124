"""The flags of ``te-dist train`` (shared by the CLI parent and the torchrun worker).

Why one definition: ``te-dist train FLAGS`` and ``torchrun ... launchers/train.py FLAGS`` must
mean the same job; the parent validates the flags, then hands them unchanged to every worker.

Every config field is a flag, spelled as its YAML path (``--model.num_experts 8``,
``--train.steps 100``, ``--recipe.fp8_format E4M3``); the familiar short names (``--steps``,
``--ep``, ...) are aliases of the same destinations, so the last one given wins. Flags left
out are absent from the namespace (``argparse.SUPPRESS``), which is how "not given" differs
from an explicit ``null``. Importing this module never imports torch (``te-dist --help`` stays fast).
"""

from __future__ import annotations

import argparse
from typing import Optional

from ..recipe import RECIPE_NAMES
from .config import JobConfig, closest, config_fields, load_config, recipe_setting_names
from .faults import FAULT_ACTIONS, FAULT_POINTS, FaultInjection

__all__ = ["add_train_arguments", "check_unknown_flags", "config_from_args", "config_overrides", "worker_argv",
           "fault_from_args", "output_options"]

# familiar short flag -> the dotted config key it sets (torchtitan / Megatron-LM users look for these)
_OVERRIDES = {
    "--steps": "train.steps",
    "--ep": "parallel.ep",
    "--out": "train.out_dir",
    "--lr": "train.lr",
    "--ckpt-every": "train.ckpt_every",
    "--log-every": "train.log_every",
    "--device": "train.device",
    "--seed": "train.seed",
    "--log": "train.log",
    "--keep-last": "train.keep_last",
}
# ``--resume`` without a directory; the same value as run_dir.RESUME_LATEST, which this module does not
# import (run_dir imports torch; tests/cli/test_flags.py checks the two agree)
RESUME_LATEST = True
# flag dest -> how the output directory is used (run_dir.py); not part of the job's config
_OUTPUT_FLAGS = ("resume", "overwrite", "skip_invalid")
_FAULT_FLAGS = ("fail_rank", "fail_step", "fail_with", "fail_at")  # testing aid (faults.py)
_RECIPE_PREFIX = "recipe."
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE or low in _FALSE:
        return low in _TRUE
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None


def _parse_optional_int(text: str) -> Optional[int]:
    return None if text.strip().lower() in ("null", "none") else _parse_int(text)


def _parse_optional_str(text: str) -> Optional[str]:
    return None if text.strip().lower() in ("null", "none") else text


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _parse_yaml_scalar(text: str):
    """A recipe setting as YAML reads it (``true``, ``null``, ``3``, ``E4M3``)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


_PARSERS = {"int": _parse_int, "float": _parse_float, "bool": _parse_bool, "str": str,
            "Optional[int]": _parse_optional_int, "Optional[str]": _parse_optional_str}
_METAVARS = {"int": "N", "float": "X", "bool": "BOOL", "str": "TEXT", "Optional[int]": "N|null",
             "Optional[str]": "TEXT|null"}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Job flags (all but the launcher's own: ``--nproc``, ``--print-config``...). Flags override the config file."""
    parser.add_argument("--config", metavar="FILE", help="YAML job config (see launchers/configs/; a saved config.yaml works too)")
    parser.add_argument("--recipe", choices=RECIPE_NAMES, default=argparse.SUPPRESS,
                        help="quantization recipe by name (default: the config's, else 'current')")
    parser.add_argument("--resume", metavar="DIR", nargs="?", const=RESUME_LATEST,
                        help="continue the run in --out (without --out: the newest run under te_dist_out/) from its "
                             "newest valid checkpoint; with DIR: start a new run from that checkpoint (a step dir, "
                             "or an out dir's newest)")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="replace the run that --out holds (its checkpoints and metrics)")
    parser.add_argument("--skip-invalid", dest="skip_invalid", action="store_true", default=None,
                        help="with --resume: pass over checkpoints that fail verification for the newest that verifies")
    parser.add_argument("--no-checkpoint", dest="train.checkpoint", action="store_const", const=False,
                        default=argparse.SUPPRESS, help="write no checkpoint at all (same as --train.checkpoint false)")
    # Testing aid (faults.py): make one rank fail or hang, to see the job end with a named error (never a hang).
    parser.add_argument("--fail-rank", type=int, dest="fail_rank", help=argparse.SUPPRESS)
    parser.add_argument("--fail-step", type=int, dest="fail_step", help=argparse.SUPPRESS)
    parser.add_argument("--fail-with", choices=FAULT_ACTIONS, dest="fail_with", help=argparse.SUPPRESS)
    parser.add_argument("--fail-at", choices=FAULT_POINTS, dest="fail_at", help=argparse.SUPPRESS)
    # Set by the te-dist parent: it already printed the resolved config and the memory estimate.
    parser.add_argument("--from-cli", action="store_true", dest="from_cli", help=argparse.SUPPRESS)

    aliases = {key: flag for flag, key in _OVERRIDES.items()}
    group = parser.add_argument_group(
        "config fields", "every key of the YAML config, as --SECTION.KEY VALUE (flags win over --config)")
    for key, type_name, default, help_text in config_fields():
        flags = [f"--{key}"] + ([aliases[key]] if key in aliases else [])
        group.add_argument(*flags, dest=key, type=_PARSERS.get(type_name, str), default=argparse.SUPPRESS,
                           metavar=_METAVARS.get(type_name, "VALUE"), help=f"{help_text} (default: {_flag_value(default)})")
    recipe_group = parser.add_argument_group(
        "recipe settings", "a setting of the selected recipe, as --recipe.KEY VALUE (see docs/recipes.md)")
    for name, doc in recipe_setting_names().items():
        if name.endswith("format") and not doc:
            doc = "element format: E4M3, E5M2, HYBRID (E4M3 forward, E5M2 backward) or E2M1"
        recipe_group.add_argument(f"--{_RECIPE_PREFIX}{name}", dest=f"{_RECIPE_PREFIX}{name}", type=_parse_yaml_scalar,
                                  default=argparse.SUPPRESS, metavar="VALUE", help=doc or "see docs/recipes.md")


def _known_flags(parser: argparse.ArgumentParser) -> list:
    return [s for action in parser._actions if action.help is not argparse.SUPPRESS
            for s in action.option_strings if s.startswith("--")]


def check_unknown_flags(parser: argparse.ArgumentParser, extras) -> None:
    """Exit 2 (``parser.error``) for flags argparse did not know, naming the closest valid ones."""
    if not extras:
        return
    flags = [e.split("=", 1)[0] for e in extras if e.startswith("--")]
    if not flags:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    known = _known_flags(parser)
    parts = []
    for flag in flags:
        hints = closest(flag, known)
        what = "config key" if "." in flag else "flag"
        parts.append(f"unknown {what} {flag}" + (f" (did you mean {', '.join(hints)}?)" if hints else ""))
    parser.error("; ".join(parts) + f"; `{parser.prog} --help` lists every flag")


def config_overrides(ns: argparse.Namespace) -> dict:
    """``{"section.key": value}`` for every config flag that was given (``recipe`` for --recipe)."""
    return {k: v for k, v in vars(ns).items() if "." in k or k == "recipe"}


def config_from_args(ns: argparse.Namespace) -> JobConfig:
    return load_config(ns.config, overrides=config_overrides(ns))


def output_options(ns: argparse.Namespace) -> dict:
    """``resume``, ``overwrite``, ``skip_invalid`` keyword arguments for ``train`` and ``plan_run``."""
    return {"resume": ns.resume, "overwrite": bool(ns.overwrite), "skip_invalid": bool(ns.skip_invalid)}


def fault_from_args(ns: argparse.Namespace) -> Optional[FaultInjection]:
    given = {name: getattr(ns, name, None) for name in _FAULT_FLAGS}
    if all(value is None for value in given.values()):
        return None
    return FaultInjection(rank=given["fail_rank"] or 0, step=given["fail_step"] or 1,
                          action=given["fail_with"] or "raise", point=given["fail_at"] or "step")


def _flag_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # str(float) round-trips exactly


def worker_argv(ns: argparse.Namespace) -> list:
    """Rebuild the job flags for the workers from parsed args (only those that were given)."""
    argv = []
    for dest in ("config", *_OUTPUT_FLAGS, *_FAULT_FLAGS):
        value = getattr(ns, dest, None)
        if value is True:  # a bare flag (--resume without DIR, --overwrite, --skip-invalid)
            argv += [f"--{dest.replace('_', '-')}"]
        elif value is not None:
            argv += [f"--{dest.replace('_', '-')}", str(value)]
    for key, value in config_overrides(ns).items():
        argv += [f"--{key}", _flag_value(value)]
    return argv
