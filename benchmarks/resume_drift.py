"""How far a run resumed on another number of ranks drifts from the run that wrote the checkpoint.

One reference job (``--nproc`` ranks, EP = ranks) writes a checkpoint at step ``--at`` and trains
to ``--steps``; each resumed job reloads that checkpoint on other rank counts (EP = ranks: the
experts are resharded) and trains to ``--steps``. Printed per resumed job: the relative loss
difference ``|resumed - reference| / reference`` at the first resumed step, at the last step, and
the largest over the resumed steps (all from the jobs' metrics.jsonl, exact floats).

    python benchmarks/resume_drift.py                                 # 2 -> 1 and 2 -> 4 ranks, recipe none
    python benchmarks/resume_drift.py --recipe current --reshard 1 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _train(out: Path, nproc: int, args, *extra) -> dict:
    cmd = [sys.executable, "-m", "te_dist.cli", "train", "--nproc", str(nproc), "--steps", str(args.steps),
           "--recipe", args.recipe, "--out", str(out), "--log-every", str(args.steps), *map(str, extra)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the reference job")
    parser.add_argument("--reshard", type=int, nargs="+", default=[1, 4], help="rank counts to resume on")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--at", type=int, default=30, help="checkpoint step the resumed jobs start from")
    parser.add_argument("--recipe", default="none")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="te_dist_drift_") as tmp:
        root = Path(tmp)
        reference = _train(root / "reference", args.nproc, args, "--ckpt-every", args.at)
        ckpt = root / "reference" / "checkpoints" / f"step_{args.at:06d}"
        print(f"resume drift: reference {args.nproc} ranks, recipe {args.recipe}, checkpoint at step {args.at}, "
              f"steps {args.at + 1}..{args.steps}")
        print(f"{'ranks':>9}{'first step rel':>16}{'last step rel':>15}{'max rel':>10}{'at step':>9}")
        for nproc in args.reshard:
            resumed = _train(root / f"resumed{nproc}", nproc, args, "--resume", ckpt, "--no-checkpoint")
            rel = {s: abs(resumed[s] - reference[s]) / abs(reference[s]) for s in range(args.at + 1, args.steps + 1)}
            worst = max(rel, key=rel.get)
            print(f"{args.nproc:>3} -> {nproc:<3}{rel[args.at + 1]:>16.2e}{rel[args.steps]:>15.2e}"
                  f"{rel[worst]:>10.2e}{worst:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
