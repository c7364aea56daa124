"""Every headline row of docs/benchmarks.md in one call: the figures as JSON under docs/data/, the plots
redrawn in docs/img/.

    python benchmarks/suite.py --gpu               # one H100 or H200, within 10 minutes
    python benchmarks/suite.py --gpu2              # the rows that need two GPUs of one host (EP=2, NCCL)
    python benchmarks/suite.py --cpu               # the CPU-box rows
    python benchmarks/suite.py --gpu --dry-run     # the plan; every command checked against its script
    python benchmarks/suite.py --gpu --data "$OUT/data" --img "$OUT/img" --logs "$OUT/logs" --only "Grouped GEMM"

``HEADLINE`` lists the steps: the headline table's area each reproduces, where it runs, the script and
its arguments, the JSON it writes and its time limit. A step runs as its own process (a crash or a hang
costs that step only) and is stopped at its limit; the suite skips what no longer fits the budget
(--budget-s) and ends with a table of what ran, also written as ``suite_<mode>.json`` beside the data. The GPU steps
expect the device scripts' setup (tests/device_env.sh: wheels, kernel cache) and, for the 10 minutes,
the CUTLASS kernels already in the cache (``bash benchmarks/run_fp8_gpu.sh build`` once, carried in
.kcache/): a cold cache builds them on first use. Where a step's scope is smaller than the docs' full
command (named in its ``note``), its JSON has its own name, so the full run's data stays.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Tuple

import timing

HERE = Path(__file__).resolve().parent
MODES = ("cpu", "gpu", "gpu2")
BUDGET_S = {"cpu": 1200, "gpu": 590, "gpu2": 590}  # one device call is 10 minutes


class Step(NamedTuple):
    area: str  # the area of the headline table of docs/benchmarks.md (its link text)
    mode: str  # cpu | gpu (one GPU) | gpu2 (two GPUs of one host)
    script: str  # a file of benchmarks/
    args: Tuple[str, ...]  # its arguments; "--json PATH" is added
    json: str  # the file it writes under --data
    limit_s: int  # its time limit
    nproc: int = 0  # > 0: launched under torchrun with this many processes
    note: str = ""  # where the scope differs from the docs' own command


HEADLINE = [
    Step("Recipe string", "cpu", "overhead.py", ("recipe",), "recipe_overhead.json", 60),
    Step("Support predicates", "cpu", "overhead.py", ("support",), "support_overhead_cpu.json", 150),
    Step("Fuser overhead", "cpu", "overhead.py", ("fuser", "--repeats", "7"), "fuser_overhead.json", 180),
    Step("Recipe consensus", "cpu", "overhead.py", ("consensus",), "consensus_cpu.json", 120),
    Step("Megatron-Core", "cpu", "megatron_experts.py",
         ("--preset", "tiny", "--dispatcher", "allgather", "--iters", "50"), "megatron_experts_cpu.json", 120),
    Step("Training", "cpu", "train.py", ("throughput", "--variants", "none:2", "none:1", "current:2", "delayed:2",
                                         "block:2"), "train_throughput_cpu.json", 300),
    # One GPU: the sum of the limits stays within BUDGET_S["gpu"] (tests/test_benchmarks.py checks it).
    Step("Support predicates", "gpu", "overhead.py", ("support", "--real-device", "--calls", "20000"),
         "support_overhead_gpu.json", 25, note="20,000 calls per repeat (docs: 50,000)"),
    Step("Quantization", "gpu", "quantize.py", ("casts", "--eager"), "quantize.json", 35,
         note="--eager: the reference rows uncompiled; the fused rows, the headline, are the same"),
    Step("Grouped GEMM", "gpu", "grouped_gemm.py", ("--rounds", "5"), "grouped_gemm.json", 90),
    Step("Measured choices", "gpu", "grouped_gemm.py", ("--sweep", "--shapes", "8", "--rounds", "3"),
         "grouped_gemm_sweep.json", 45, note="8 drawn shapes, 3 rounds (docs: 24 shapes, 5 rounds)"),
    Step("MoE layer", "gpu", "moe_layer.py", ("--backend", "nccl"), "moe_layer_ep1.json", 45, nproc=1,
         note="EP=1 on one GPU (the EP=2 rows: --gpu2)"),
    Step("FP8 expert MLP", "gpu", "fp8_gemm.py", ("grouped", "--shapes", "dsv3_fc1,dsv3_fc2,mixtral_fc1,mixtral_fc2",
                                                  "--splits", "even"), "fp8_grouped_gemm.json", 35,
         note="even splits (docs: also the ragged DSv3 fc1 row)"),
    Step("FP8 expert MLP", "gpu", "fp8_gemm.py", ("ceiling", "--shapes", "dsv3_fc1", "--per-expert-max", "0"),
         "fp8_ceiling_dsv3_fc1.json", 25, note="DSv3 fc1, the dense cuBLAS columns"),
    Step("FP8 expert MLP", "gpu", "quantize.py", ("weights",), "weight_cast.json", 25),
    Step("FP8 expert MLP", "gpu", "fp8_layer.py", ("--configs", "mixtral,deepseek,qwen3_30b", "--iters", "5",
                                                   "--warmup", "2"), "fp8_layer.json", 50,
         note="3 of the 5 configs, 5 steps (docs: all 5, 8 steps, --fixed)"),
    Step("FP8 expert MLP", "gpu", "overhead.py", ("mlp-host", "--rounds", "5"), "mlp_host.json", 25),
    Step("FP8 expert MLP", "gpu", "train.py", ("throughput", "--nproc", "1", "--device", "cuda", "--steps", "300",
                                               "--seed", "1", "--variants", "none:1", "block:1"),
         "train_loss_gpu.json", 155),
    Step("Megatron-Core", "gpu", "megatron_experts.py", ("--preset", "deepseek", "--dispatcher", "alltoall"),
         "megatron_experts.json", 35),
    # Two GPUs of one host.
    Step("MoE layer", "gpu2", "moe_layer.py", ("--backend", "nccl", "--ep-sizes", "2"), "moe_layer.json", 180,
         nproc=2),
    Step("Recipe consensus", "gpu2", "overhead.py", ("consensus", "--backend", "nccl", "--steps", "300"),
         "consensus_gpu.json", 90),
    Step("Training", "gpu2", "train.py", ("throughput", "--nproc", "2", "--config",
                                          "launchers/configs/mixtral_like.yaml", "--steps", "12", "--variants",
                                          "none:2", "none:1"),
         "train_throughput_gpu2.json", 150),
]


def command(step: Step, data: Path) -> list:
    launcher = [sys.executable]
    if step.nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={step.nproc}"]
    return [*launcher, str(HERE / step.script), *step.args, "--json", str(data / step.json)]


def shown(step: Step, data: Path) -> str:
    """The step's command as a reader types it from the repository root."""
    words = command(step, data)
    words[0] = "torchrun" if step.nproc else "python"
    words = [w for w in words if w not in ("-m", "torch.distributed.run")]
    return " ".join(str(Path(w).relative_to(timing.REPO)) if w.startswith(str(timing.REPO)) else w for w in words)


def load_script(path: Path):
    """Import a benchmark script as module bench_<stem>, running nothing."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    name = f"bench_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def check(steps) -> list:
    """Every script of benchmarks/ imports; every step's arguments parse with its script's own parser.
    Returns the problems found."""
    problems, modules = [], {}
    for path in sorted(HERE.glob("*.py")):
        try:
            modules[path.name] = load_script(path)
        except Exception as exc:  # noqa: BLE001 - reported, the check goes on
            problems.append(f"{path.name}: import failed: {type(exc).__name__}: {exc}")
    for step in steps:
        module = modules.get(step.script)
        if module is None:
            problems.append(f"{step.area}: {step.script} is not an importable script of benchmarks/")
            continue
        try:
            module.build_parser().parse_args([*step.args, "--json", step.json])
        except SystemExit as exc:
            problems.append(f"{step.area}: {step.script} {' '.join(step.args)}: its parser refused it "
                            f"(exit {exc.code})")
    return problems


def run_step(step: Step, data: Path, logs: Path, limit_s: float) -> dict:
    log = logs / f"{Path(step.json).stem}.txt"
    cmd = command(step, data)
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, cwd=timing.REPO, env=timing.repo_env(PYTHONUNBUFFERED="1"), stdout=out,
                                stderr=subprocess.STDOUT, timeout=limit_s).returncode
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = f"stopped at its limit ({limit_s:.0f} s)"
    seconds = time.perf_counter() - start
    tail = log.read_text(errors="replace").splitlines()[-12:]
    print(f"== {step.area}: {step.script} {' '.join(step.args)}: {status} in {seconds:.0f} s")
    print("\n".join("   " + line for line in tail), flush=True)
    return dict(area=step.area, script=step.script, args=list(step.args), json=step.json, status=status,
                seconds=round(seconds, 1), note=step.note, log=str(log))


def redraw(data: Path, img: Path) -> str:
    try:
        plots = load_script(HERE / "plots.py")
        return "plots redrawn" if plots.main(["--data", str(data), "--out", str(img)]) == 0 else "no data to plot"
    except ImportError as exc:  # matplotlib is optional
        return f"plots not redrawn: {exc}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    for name in MODES:
        mode.add_argument(f"--{name}", dest="mode", action="store_const", const=name)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and check every command; run nothing")
    parser.add_argument("--only", default=None, help="the steps whose area contains this text")
    parser.add_argument("--data", type=Path, default=timing.REPO / "docs" / "data")
    parser.add_argument("--img", type=Path, default=timing.REPO / "docs" / "img")
    parser.add_argument("--logs", type=Path, default=None, help="each step's output (default: a temporary folder)")
    parser.add_argument("--budget-s", type=float, default=None, help="skip what no longer fits (default: per mode)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    steps = [s for s in HEADLINE if s.mode == args.mode and (not args.only or args.only.lower() in s.area.lower())]
    budget = args.budget_s or BUDGET_S[args.mode]
    print(f"# {len(steps)} steps for --{args.mode}, limits summing to {sum(s.limit_s for s in steps)} s "
          f"(budget {budget:.0f} s)")
    for s in steps:
        print(f"  [{s.area}] {shown(s, args.data)}  (limit {s.limit_s} s{'; ' + s.note if s.note else ''})")
    problems = check(steps)
    for p in problems:
        print(f"PROBLEM: {p}")
    if problems or args.dry_run:
        return 1 if problems else 0
    args.data.mkdir(parents=True, exist_ok=True)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="te_dist_suite_"))
    logs.mkdir(parents=True, exist_ok=True)
    start, results = time.perf_counter(), []
    for s in steps:
        left = budget - (time.perf_counter() - start)
        if left < min(s.limit_s, 20):
            results.append(dict(area=s.area, script=s.script, args=list(s.args), json=s.json,
                                status="skipped: over the budget", seconds=0.0, note=s.note))
            print(f"== {s.area}: {s.script} {' '.join(s.args)}: skipped, {left:.0f} s of the budget left")
            continue
        results.append(run_step(s, args.data, logs, min(s.limit_s, left)))
    plots = redraw(args.data, args.img)
    print(f"\n# {plots}; logs in {logs}\n| area | step | status | s |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['area']} | {r['script']} {' '.join(r['args'])} | {r['status']} | {r['seconds']:.0f} |")
    (args.data / f"suite_{args.mode}.json").write_text(json.dumps({"mode": args.mode, "steps": results}, indent=1))
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
