"""Training throughput of `te-dist train`: tokens/s per variant, as a ratio to a baseline run.

Each variant is one real `te-dist train` job (torchrun workers included); tokens/s is the mean
over the steps after the first two (warm-up), read from the job's metrics.jsonl. The baseline is
the first variant, measured in the same invocation (machines are noisy; compare ratios).

    python benchmarks/train_throughput.py                                  # 2 CPU ranks, tiny model
    python benchmarks/train_throughput.py --nproc 2 --config launchers/configs/mixtral_like.yaml \
        --steps 12 --variants none:2 none:1 current:2                      # 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_variant(recipe: str, ep: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="te_dist_bench_") as out:
        cmd = [sys.executable, "-m", "te_dist.cli", "train", "--nproc", str(args.nproc), "--steps", str(args.steps),
               "--recipe", recipe, "--ep", str(ep), "--out", out, "--no-checkpoint", "--log-every", str(args.steps)]
        if args.config:
            cmd += ["--config", args.config]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"variant {recipe}:{ep} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s"] for r in rows if r["step"] > 2] or [r["tokens_per_s"] for r in rows]
    return {"recipe": recipe, "ep": ep, "tokens_per_s": statistics.mean(steady),
            "median_tokens_per_s": statistics.median(steady), "first_loss": rows[0]["loss"],
            "last_loss": rows[-1]["loss"], "job_wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--config", default=None)
    parser.add_argument("--variants", nargs="+", default=["none:2", "none:1", "current:2", "delayed:2"],
                        help="recipe:ep pairs; the first is the baseline")
    args = parser.parse_args()
    results = []
    for spec in args.variants:
        recipe, _, ep = spec.partition(":")
        results.append(run_variant(recipe, int(ep or args.nproc), args))
    base = results[0]["tokens_per_s"]
    print(f"te-dist train throughput: nproc={args.nproc} steps={args.steps} config={args.config or 'defaults'}")
    print(f"{'recipe':<10}{'ep':>4}{'tokens/s':>14}{'median':>12}{'ratio':>8}{'loss first->last':>22}{'job wall s':>12}")
    for r in results:
        print(f"{r['recipe']:<10}{r['ep']:>4}{r['tokens_per_s']:>14,.0f}{r['median_tokens_per_s']:>12,.0f}"
              f"{r['tokens_per_s'] / base:>8.2f}{r['first_loss']:>11.4f} -> {r['last_loss']:<7.4f}{r['job_wall_s']:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
