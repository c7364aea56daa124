"""The flags of ``te-dist train`` (shared by the CLI parent and the torchrun worker).

Why one definition: ``te-dist train FLAGS`` and ``torchrun ... launchers/train.py FLAGS`` must
mean the same job; the parent validates the flags, then hands them unchanged to every worker.
"""

from __future__ import annotations

import argparse
from typing import Optional

from ..recipe import RECIPE_NAMES
from .config import JobConfig, load_config
from .loop import FaultInjection
from .run_dir import RESUME_LATEST

__all__ = ["add_train_arguments", "config_from_args", "worker_argv", "fault_from_args", "output_options"]

# flag dest -> dotted config key it overrides
_OVERRIDES = {
    "steps": "train.steps",
    "recipe": "recipe",
    "ep": "parallel.ep",
    "out": "train.out_dir",
    "lr": "train.lr",
    "ckpt_every": "train.ckpt_every",
    "log_every": "train.log_every",
    "device": "train.device",
    "seed": "train.seed",
    "checkpoint": "train.checkpoint",
    "keep_last": "train.keep_last",
}
# flag dest -> how the output directory is used (run_dir.py); not part of the job's config
_OUTPUT_FLAGS = ("resume", "overwrite", "skip_invalid")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Job flags (all but ``--nproc``, which only the launcher reads). Flags override the config file."""
    parser.add_argument("--config", metavar="FILE", help="YAML job config (see launchers/configs/)")
    parser.add_argument("--steps", type=int, help="total training steps (a resumed run continues up to this step)")
    parser.add_argument("--recipe", choices=RECIPE_NAMES, help="quantization recipe by name (default: the config's, else 'current')")
    parser.add_argument("--ep", type=int, help="expert-parallel size (default: all ranks)")
    parser.add_argument("--resume", metavar="DIR", nargs="?", const=RESUME_LATEST,
                        help="continue the run in --out from its newest valid checkpoint; with DIR: start from that "
                             "checkpoint (a step dir, or an out dir's newest)")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="replace the run that --out holds (its checkpoints and metrics)")
    parser.add_argument("--skip-invalid", dest="skip_invalid", action="store_true", default=None,
                        help="with --resume: pass over checkpoints that fail verification for the newest that verifies")
    parser.add_argument("--keep-last", type=int, dest="keep_last", metavar="K",
                        help="keep only the newest K checkpoints (default 0: all)")
    parser.add_argument("--out", metavar="DIR", help="output dir for checkpoints and metrics.jsonl (default te_dist_out)")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--ckpt-every", type=int, dest="ckpt_every", help="checkpoint every K steps (0: only at the end)")
    parser.add_argument("--no-checkpoint", dest="checkpoint", action="store_const", const=False,
                        help="write no checkpoint at all (benchmarks)")
    parser.add_argument("--log-every", type=int, dest="log_every", help="print progress every K steps")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="auto: one GPU per rank when GPUs exist")
    parser.add_argument("--seed", type=int, help="model initialisation seed")
    # Testing aid: make one rank fail, to see the job end with that rank's error (never a hang).
    parser.add_argument("--fail-rank", type=int, dest="fail_rank", help=argparse.SUPPRESS)
    parser.add_argument("--fail-step", type=int, dest="fail_step", help=argparse.SUPPRESS)


def config_from_args(ns: argparse.Namespace) -> JobConfig:
    overrides = {key: getattr(ns, dest) for dest, key in _OVERRIDES.items() if getattr(ns, dest, None) is not None}
    return load_config(ns.config, overrides=overrides)


def output_options(ns: argparse.Namespace) -> dict:
    """``resume``, ``overwrite``, ``skip_invalid`` keyword arguments for ``train`` and ``plan_run``."""
    return {"resume": ns.resume, "overwrite": bool(ns.overwrite), "skip_invalid": bool(ns.skip_invalid)}


def fault_from_args(ns: argparse.Namespace) -> Optional[FaultInjection]:
    if ns.fail_rank is None and ns.fail_step is None:
        return None
    return FaultInjection(rank=ns.fail_rank or 0, step=ns.fail_step or 1)


def worker_argv(ns: argparse.Namespace) -> list:
    """Rebuild the job flags for the workers from parsed args (only those that were given)."""
    argv = []
    for dest in ("config", *_OVERRIDES, *_OUTPUT_FLAGS, "fail_rank", "fail_step"):
        value = getattr(ns, dest, None)
        if dest == "checkpoint":
            argv += ["--no-checkpoint"] if value is False else []
        elif value is True:  # a bare flag (--resume without DIR, --overwrite, --skip-invalid)
            argv += [f"--{dest.replace('_', '-')}"]
        elif value is not None:
            argv += [f"--{dest.replace('_', '-')}", str(value)]
    return argv
