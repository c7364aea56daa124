"""The ``te-dist`` command.

    te-dist train [--nproc N] [--config FILE] [--SECTION.KEY VALUE ...] [--print-config] [--resume DIR] ...
    te-dist plot [OUT ...] [--to DIR]
    te-dist env [--json]
    te-dist tune --shapes FILE [--bucket-ms MS] [--device cuda:N]
    te-dist --version

``train`` prints what it launches at once, validates the job in this process (a bad config fails
here with exit code 2, before any rank starts), prints the resolved config and a memory estimate,
checks and tokenizes a ``--data.path`` file, then runs the ranks under torchrun and returns its
exit code. ``plot`` draws the loss and throughput of one or several runs, by default the newest
(te_dist/train/plots.py, needs matplotlib). ``env`` reports versions, backends and the
grouped-GEMM support matrix for every visible device and recipe. ``tune`` measures the
grouped-GEMM choices of a list of shapes ahead of a run (``te_dist/tune.py``).

Building the parser and ``--help``/``--version`` never import torch (they answer in a fraction of
a second); ``train`` imports it only for checks that need it (GPUs, a checkpoint to resume).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import shutil
import signal
import sys
from typing import Optional, Sequence

__all__ = ["main", "build_parser", "env_report", "format_env_report"]

EXIT_USAGE = 2  # argparse's code for bad usage; also used for a bad config


class _VersionAction(argparse.Action):
    """``--version``: te_dist's and torch's versions, read from package metadata (torch is not imported)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from . import __version__

        parser.exit(message=f"te-dist {__version__} (torch {_version_of('torch') or 'not installed'}, "
                            f"python {platform.python_version()})\n")


def build_parser() -> argparse.ArgumentParser:
    from .train.args import add_train_arguments
    from .tune import add_arguments as add_tune_arguments

    parser = argparse.ArgumentParser(prog="te-dist", description="te_dist: expert-parallel MoE training tools",
                                     allow_abbrev=False)
    parser.add_argument("--version", action=_VersionAction, help="print the te_dist and torch versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a small MoE transformer (starts its own torchrun workers)",
                           description="Train a small MoE transformer on synthetic text or a --data.path file "
                                       "(tokens or text); starts its own torchrun workers. Every config field is a "
                                       "--SECTION.KEY flag (below).",
                           usage="%(prog)s [--nproc N] [--config FILE] [--SECTION.KEY VALUE ...] [--print-config] "
                                 "[--resume DIR] [options]",
                           allow_abbrev=False)
    train.add_argument("--nproc", type=int, help="ranks on this machine (default: number of GPUs, else 2)")
    train.add_argument("--print-config", action="store_true",
                       help="print the resolved config as YAML (usable as --config) and exit")
    train.add_argument("--skip-memory-check", action="store_true",
                       help="launch a CPU job even when its memory estimate exceeds the machine's available memory")
    add_train_arguments(train)
    plot = sub.add_parser("plot", help="draw loss and throughput of runs (several runs: one chart)",
                          description="Draw loss.png (train and validation loss against steps and tokens) and "
                                      "throughput.png (tokens/s, memory) of one or several te-dist train output "
                                      "directories (default: the newest run), every run on the same axes. "
                                      "Needs matplotlib.",
                          allow_abbrev=False)
    plot.add_argument("out_dirs", nargs="*", metavar="OUT",
                      help="a te-dist train output directory (default: the newest run, te_dist_out/latest)")
    plot.add_argument("--to", metavar="DIR", help="where to write the PNGs (default: OUT/plots for one run, "
                                                  "./te_dist_plots for several)")
    env = sub.add_parser("env", help="versions, backends and the support matrix per device and recipe")
    env.add_argument("--json", action="store_true", help="print machine-readable JSON")
    tune = sub.add_parser("tune", help="measure the grouped-GEMM choices of a list of shapes ahead of a run (GPU)",
                          description="Time the grouped-GEMM candidates of every shape in FILE on this GPU and write "
                                      "the choices where runs read them (the kernel cache's autotune/ folder).",
                          allow_abbrev=False)
    add_tune_arguments(tune)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


# --------------------------------------------------------------------------- train


def _say(text: str) -> None:
    print(text, flush=True)


def _train(ns: argparse.Namespace) -> int:
    from .train.args import config_from_args, output_options, worker_argv
    from .train.config import ConfigError
    from .train.job_watch import JobLimits
    from .train.launch import launch
    from .train.preflight import check_gpus, check_logging, first_line, memory_report, plan_launch
    from .train.resolved import config_yaml, resolved_config, summary_lines
    from .train.run_dirs import choose_out_dir, point_latest

    chosen = None  # the output directory (a new one under te_dist_out/ when --out is not given)
    try:
        cfg = config_from_args(ns)
        plan = plan_launch(cfg, ns.nproc)
        if not ns.print_config:
            chosen = choose_out_dir(cfg.train.out_dir, resume=ns.resume, overwrite=bool(ns.overwrite))
            cfg.train.out_dir = str(chosen.path)
            setattr(ns, "train.out_dir", cfg.train.out_dir)  # the ranks write where the parent chose
            _say(first_line(plan, config=ns.config, out_dir=cfg.train.out_dir, resume=ns.resume,
                            new_dir=chosen.created))
            if chosen.note:
                _say(chosen.note)
        cfg.validate(world_size=plan.nproc)
        resolved = resolved_config(cfg, world_size=plan.nproc)
        if ns.print_config:
            print(config_yaml(resolved), end="")
            return 0
        for line in summary_lines(resolved):
            _say(line)
        check_logging(cfg)
        if plan.device == "cuda":
            plan, note = check_gpus(cfg, plan)
            if note:
                _say(note)
                cfg.validate(world_size=plan.nproc)
        _say(memory_report(cfg, plan, enforce=not ns.skip_memory_check))
        from .train.run_dir import plan_run  # imports torch: after the first line

        run_plan = plan_run(cfg, **output_options(ns))  # reads only: refuses a taken --out or a bad checkpoint, exit 2
        if ns.fail_rank is not None and not 0 <= ns.fail_rank < plan.nproc:
            raise ConfigError(f"--fail-rank {ns.fail_rank} is not a rank of a {plan.nproc}-rank job")
        if run_plan.checkpoint is not None and run_plan.step >= cfg.train.steps:
            # e.g. a run whose rank hung at exit after its last checkpoint (exit code 3): nothing is left to do
            _unclaim(chosen)
            _say(f"[te-dist] the run is complete: checkpoint {run_plan.checkpoint} is at step {run_plan.step} and "
                 f"train.steps is {cfg.train.steps}; nothing to do (raise --steps to train further)")
            return 0
        from .train.datasets import prepare_data

        data_plan = prepare_data(cfg)  # a bad --data.path: exit 2 here; text is tokenized once, for every rank
        if data_plan is not None and data_plan.cache_line():
            _say(data_plan.cache_line())
    except ConfigError as exc:
        _unclaim(chosen)
        print(f"te-dist train: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BaseException:
        _unclaim(chosen)
        raise
    if chosen.created:
        point_latest(chosen.path.parent, chosen.path)
    # The launcher prints the job's outcome in one line when it did not succeed (job_watch.py).
    code = launch(plan.nproc, [*worker_argv(ns), "--from-cli"], limits=JobLimits.from_config(cfg.train),
                  log_dir=chosen.path / "logs")
    if "torch" in sys.modules:
        import gc

        gc.freeze()  # exit without the collections that walk all of torch's objects (see train/worker.py)
    return code


def _unclaim(chosen) -> None:
    """Remove the new run directory of a job that never started (it is still empty)."""
    if chosen is not None and chosen.created:
        try:
            chosen.path.rmdir()
        except OSError:  # not empty after all: leave it
            pass


# --------------------------------------------------------------------------- plot


def _plot(ns: argparse.Namespace) -> int:
    from .train.plots import PlotError, runs_to_plot, write_plots

    try:
        paths = write_plots(runs_to_plot(ns.out_dirs), ns.to)
    except (PlotError, ImportError) as exc:
        print(f"te-dist plot: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for path in paths:
        print(path)
    return 0


# --------------------------------------------------------------------------- env


def _version_of(module_name: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(module_name)
    except Exception:
        return None


def _devices() -> list:
    import torch

    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return devices


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{device} ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"
    return f"cpu ({platform.processor() or platform.machine()})"


def _backends(devices) -> dict:
    import torch
    import torch.distributed as dist

    out = {
        "torch._grouped_mm": hasattr(torch, "_grouped_mm"),
        "torch._scaled_grouped_mm": hasattr(torch, "_scaled_grouped_mm"),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available(),
        "nvcc": shutil.which("nvcc"),
        "nvidia-cutlass wheel": _version_of("nvidia-cutlass"),
    }
    for device in devices:
        key = f"grouped_mm backends on {device}"
        try:
            kernels = importlib.import_module("te_dist.kernels")
            out[key] = ", ".join(kernels.available_backends(device))
        except Exception as exc:  # report, never crash: this command is what users run when things break
            out[key] = f"unavailable ({type(exc).__name__}: {exc})"
    return out


SPLIT_ALIGNMENT = 128  # the alignment the matrix assumes (every block format's tile divides it)


def _support_matrix(devices) -> dict:
    """{device: {recipe name: {dtype: {"module": bool, "op_fuser": bool}}}} (or an error string)."""
    import torch

    from .recipe import RECIPE_NAMES, recipe_from_name

    try:
        support = importlib.import_module("te_dist.support")
    except Exception as exc:
        return {"error": f"te_dist.support unavailable ({type(exc).__name__}: {exc})"}
    matrix = {}
    for device in devices:
        rows = {}
        for name in RECIPE_NAMES:
            recipe = recipe_from_name(name)
            cells = {}
            for dtype in (torch.bfloat16, torch.float32):
                cell = {}
                for kind, fn in (("module", support.is_module_grouped_tensor_supported),
                                 ("op_fuser", support.is_op_fuser_grouped_tensor_supported)):
                    try:
                        cell[kind] = bool(fn(recipe, dtype, split_alignment=SPLIT_ALIGNMENT, device=device))
                    except Exception as exc:
                        cell[kind] = f"error: {type(exc).__name__}: {exc}"
                cells[str(dtype).replace("torch.", "")] = cell
            rows[name] = cells
        matrix[str(device)] = rows
    return matrix


def _paths(devices) -> dict:
    """{device: {recipe name: [path, why]}}: which path a bf16 expert MLP takes (support.explain_path)."""
    import torch

    from .recipe import RECIPE_NAMES, recipe_from_name

    out = {}
    for device in devices:
        rows = {}
        for name in RECIPE_NAMES:
            try:
                rows[name] = list(importlib.import_module("te_dist.support").explain_path(
                    recipe_from_name(name), torch.bfloat16, device=device))
            except Exception as exc:  # report, never crash
                rows[name] = ["error", f"{type(exc).__name__}: {exc}"]
        out[str(device)] = rows
    return out


def _settings_report() -> dict:
    """{field: {value, source, env, default}} of te_dist.settings, or {"error": why} for a bad variable."""
    from . import settings

    try:
        return settings.describe()
    except ValueError as exc:
        return {"error": str(exc)}


def _transport(devices) -> dict:
    """The token transport an MoELayer would use: the request (``te_dist.settings.ep_transport``
    overrides the layer's ``transport="auto"``) and what "auto" picks per device (docs/moe.md "Transports")."""
    from .moe.transports.selector import requested_transport

    try:
        requested, source = requested_transport("auto")
    except ValueError as exc:
        return {"requested": f"invalid: {exc}"}
    picks = {}
    for device in devices:
        if requested != "auto":
            picks[str(device)] = requested
        elif device.type != "cuda":
            picks[str(device)] = "all_to_all (peer memory needs CUDA tensors)"
        else:
            picks[str(device)] = ("peer where every rank of the EP group runs NCCL on this host with symmetric "
                                  "memory and the peer kernels load, else all_to_all (agreed at the first forward)")
    return {"requested": f"{requested} ({source})", "auto picks": picks}


def env_report() -> dict:
    import torch

    from . import __version__

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:
            nccl = f"unknown ({exc})"
    devices = _devices()
    return {
        "versions": {
            "te_dist": __version__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda (torch build)": torch.version.cuda,
            "cuda available": torch.cuda.is_available(),
            "nccl": nccl,
            "numpy": _version_of("numpy"),
            "megatron-core": _version_of("megatron-core"),
        },
        "devices": [_device_name(d) for d in devices],
        "backends": _backends(devices),
        "support": _support_matrix(devices),
        "paths": _paths(devices),
        "transport": _transport(devices),
        "settings": _settings_report(),
    }


def _mark(value) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return str(value)


def format_env_report(report: dict) -> str:
    lines = ["te_dist environment", "", "versions:"]
    lines += [f"  {k:<22} {_mark(v)}" for k, v in report["versions"].items()]
    lines += ["", "devices:"] + [f"  {d}" for d in report["devices"]]
    lines += ["", "backends:"] + [f"  {k:<32} {_mark(v)}" for k, v in report["backends"].items()]
    lines += ["", "grouped-tensor support (module / op fuser) per device, recipe and dtype, "
              f"splits aligned to {SPLIT_ALIGNMENT} rows:"]
    support = report["support"]
    if "error" in support:
        lines.append(f"  {support['error']}")
        return "\n".join(lines)
    for device, rows in support.items():
        dtypes = list(next(iter(rows.values())).keys())
        lines.append(f"  {device}")
        lines.append("    " + f"{'recipe':<10}" + "".join(f"{d:>22}" for d in dtypes))
        for name, cells in rows.items():
            text = "".join(f"{_mark(c['module']) + ' / ' + _mark(c['op_fuser']):>22}" for c in cells.values())
            lines.append(f"    {name:<10}{text}")
    lines += ["", "switches (te_dist.settings, docs/settings.md):"]
    switches = report.get("settings", {})
    if "error" in switches:
        lines.append(f"  invalid: {switches['error']}")
    else:
        lines += [f"  {name:<18} {row['value']!r:<8} {row['source']}" for name, row in switches.items()]
    transport = report.get("transport", {})
    lines += ["", f"token transport (EP > 1): {transport.get('requested')}"]
    lines += [f"  {device:<10} {pick}" for device, pick in transport.get("auto picks", {}).items()]
    lines += ["", "which path a bf16 MoE expert MLP takes per device and recipe, and why:"]
    for device, rows in report.get("paths", {}).items():
        lines.append(f"  {device}")
        for name, (path, why) in rows.items():
            lines.append(f"    {name:<10}{path:<10}{why}")
    return "\n".join(lines)


def _env(ns: argparse.Namespace) -> int:
    report = env_report()
    print(json.dumps(report, indent=1, default=str) if ns.json else format_env_report(report))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .train.args import check_unknown_flags

    parser = build_parser()
    ns, extras = parser.parse_known_args(argv)
    if ns.command == "train":
        check_unknown_flags(_subparser(parser, "train"), extras)
        try:
            return _train(ns)
        except KeyboardInterrupt:  # Ctrl-C before the ranks started (later the launcher handles it)
            print("te-dist train: interrupted by SIGINT before the job started", file=sys.stderr)
            return 128 + signal.SIGINT
    if extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if ns.command == "tune":
        from .tune import run

        return run(ns)
    if ns.command == "plot":
        return _plot(ns)
    return _env(ns)


if __name__ == "__main__":
    sys.exit(main())
