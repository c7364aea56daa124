"""`te-dist train` end to end: throughput per variant, and the drift of a run resumed on other rank counts.

    python benchmarks/train.py throughput                          # 2 CPU ranks, the default tiny model
    python benchmarks/train.py throughput --nproc 2 --config launchers/configs/mixtral_like.yaml \
        --steps 12 --variants none:2 none:1                        # 2 GPUs
    python benchmarks/train.py throughput --nproc 1 --device cuda --steps 300 --seed 1 --variants none block
    python benchmarks/train.py resume-drift [--recipe none] [--reshard 1 4]

``throughput``: each variant (``recipe:ep``; the first is the baseline) is one real `te-dist train` job,
torchrun workers included; tokens/s is the mean over the steps after the first two, read from the job's
metrics.jsonl, with the first and last loss.

``resume-drift``: one reference job (``--nproc`` ranks, EP = ranks) writes a checkpoint at step ``--at``
and trains to ``--steps``; each resumed job reloads it on another rank count (the experts resharded)
and trains to ``--steps``. Printed per resumed job: ``|resumed - reference| / reference`` of the loss
at the first resumed step, the last step, and the largest over the resumed steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import timing


def te_dist_train(out: Path, nproc: int, *extra) -> list:
    """Run ``te-dist train --nproc N --out OUT *extra`` from this checkout; the rows of its metrics.jsonl."""
    cmd = [sys.executable, "-m", "te_dist.cli", "train", "--nproc", str(nproc), "--out", str(out), *map(str, extra)]
    proc = subprocess.run(cmd, env=timing.repo_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def throughput(args) -> list:
    results = []
    for spec in args.variants:
        recipe, _, ep = spec.partition(":")
        extra = ["--steps", args.steps, "--recipe", recipe, "--ep", ep or args.nproc, "--no-checkpoint",
                 "--log-every", args.steps]
        extra += ["--config", args.config] if args.config else []
        extra += ["--device", args.device] if args.device else []
        extra += ["--seed", args.seed] if args.seed is not None else []
        with tempfile.TemporaryDirectory(prefix="te_dist_bench_") as out:
            t0 = time.perf_counter()
            rows = te_dist_train(Path(out), args.nproc, *extra)
            wall = time.perf_counter() - t0
        steady = [r["tokens_per_s"] for r in rows if r["step"] > 2] or [r["tokens_per_s"] for r in rows]
        results.append({"recipe": recipe, "ep": int(ep or args.nproc), "tokens_per_s": statistics.mean(steady),
                        "median_tokens_per_s": statistics.median(steady), "first_loss": rows[0]["loss"],
                        "last_loss": rows[-1]["loss"], "job_wall_s": wall})
    base = results[0]["tokens_per_s"]
    print(f"te-dist train throughput: nproc={args.nproc} steps={args.steps} config={args.config or 'defaults'}")
    print(f"{'recipe':<10}{'ep':>4}{'tokens/s':>14}{'median':>12}{'ratio':>8}{'loss first->last':>22}"
          f"{'job wall s':>12}")
    for r in results:
        r["ratio"] = r["tokens_per_s"] / base
        print(f"{r['recipe']:<10}{r['ep']:>4}{r['tokens_per_s']:>14,.0f}{r['median_tokens_per_s']:>12,.0f}"
              f"{r['ratio']:>8.2f}{r['first_loss']:>11.4f} -> {r['last_loss']:<7.4f}{r['job_wall_s']:>12.1f}")
    return results


def resume_drift(args) -> list:
    common = ["--steps", args.steps, "--recipe", args.recipe, "--log-every", args.steps]
    rows = []
    with tempfile.TemporaryDirectory(prefix="te_dist_drift_") as tmp:
        root = Path(tmp)
        reference = {r["step"]: r["loss"] for r in te_dist_train(root / "reference", args.nproc, *common,
                                                                  "--ckpt-every", args.at)}
        ckpt = root / "reference" / "checkpoints" / f"step_{args.at:06d}"
        print(f"resume drift: reference {args.nproc} ranks, recipe {args.recipe}, checkpoint at step {args.at}, "
              f"steps {args.at + 1}..{args.steps}")
        print(f"{'ranks':>9}{'first step rel':>16}{'last step rel':>15}{'max rel':>10}{'at step':>9}")
        for nproc in args.reshard:
            resumed = {r["step"]: r["loss"] for r in te_dist_train(root / f"resumed{nproc}", nproc, *common,
                                                                    "--resume", ckpt, "--no-checkpoint")}
            rel = {s: abs(resumed[s] - reference[s]) / abs(reference[s]) for s in range(args.at + 1, args.steps + 1)}
            worst = max(rel, key=rel.get)
            rows.append(dict(reference_ranks=args.nproc, ranks=nproc, first_rel=rel[args.at + 1],
                             last_rel=rel[args.steps], max_rel=rel[worst], max_at_step=worst))
            print(f"{args.nproc:>3} -> {nproc:<3}{rel[args.at + 1]:>16.2e}{rel[args.steps]:>15.2e}"
                  f"{rel[worst]:>10.2e}{worst:>9}")
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("throughput", help="tokens/s and loss per variant, against the first variant")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--config", default=None)
    p.add_argument("--device", default=None, help="te-dist train --device (default: its own choice)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--variants", nargs="+", default=["none:2", "none:1", "current:2", "delayed:2"],
                   help="recipe:ep pairs (ep defaults to --nproc); the first is the baseline")
    p = sub.add_parser("resume-drift", help="loss drift of a run resumed on other rank counts")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the reference job")
    p.add_argument("--reshard", type=int, nargs="+", default=[1, 4], help="rank counts to resume on")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--at", type=int, default=30, help="checkpoint step the resumed jobs start from")
    p.add_argument("--recipe", default="none")
    timing.add_json_option(*sub.choices.values())
    return parser


def main(argv=None) -> int:
    return timing.run_subcommand(build_parser(), {"throughput": throughput, "resume-drift": resume_drift}, "train",
                                 argv)


if __name__ == "__main__":
    sys.exit(main())
