"""Resident memory of `te-dist train` on a large token file: the file is memory-mapped, never loaded.

    python benchmarks/token_file_memory.py [--gib 1] [--steps 200] [--nproc 2]

Trains the same job three times, on the synthetic data, on a 1 MiB token file and on a token
file of ``--gib`` GiB (the 1 MiB of random tokens repeated, written to a temporary folder), and
prints rank 0's peak RSS (``max_rss_gib`` of metrics.jsonl) after step 1 and after the last step
of each, and the peak RSS of the parent's one pass over the large file (the check before any rank
starts, run here in-process). A loaded file would add its size (4x as int64 tokens) to rank 0's
memory; what all runs grow by alike is the training's own (allocator caches), not the data's.
The tokens are random, not zeros: a file of one token sends every token to the same experts,
and that rank's larger activations would show as growth of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _train(work: Path, data, out: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "te_dist.cli", "train", "--nproc", str(args.nproc), "--data.path", str(data or ""),
           "--model.vocab_size", "64", "--steps", str(args.steps), "--no-checkpoint", "--train.plots", "false",
           "--data.seq_len", "256", "--data.global_batch_size", "16", "--log-every", str(args.steps),
           "--out", out]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        sys.exit(f"te-dist train failed ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (work / out / "metrics.jsonl").read_text().splitlines()]
    return {"first": rows[0]["max_rss_gib"] * 1024, "last": rows[-1]["max_rss_gib"] * 1024}


def _parent_scan_mib(work: Path, data: Path) -> float:
    sys.path.insert(0, str(ROOT))
    from te_dist.train.config import load_config
    from te_dist.train.datasets import prepare_data

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cfg = load_config(overrides={"data.path": str(data), "model.vocab_size": 64, "train.out_dir": str(work / "scan"),
                                 "data.seq_len": 256, "data.global_batch_size": 16})
    prepare_data(cfg)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="token_file_memory_") as tmp:
        work = Path(tmp)
        small, large = work / "small.bin", work / "large.bin"
        block = np.random.default_rng(0).integers(0, 64, MiB // 2, dtype=np.uint16).tobytes()
        small.write_bytes(block)
        with open(large, "wb") as f:
            for _ in range(int(args.gib * 1024)):
                f.write(block)
        scan = _parent_scan_mib(work, large)
        runs = {"synthetic": _train(work, None, "synthetic_out", args), "1 MiB": _train(work, small, "small_out", args),
                f"{args.gib:g} GiB": _train(work, large, "large_out", args)}
    print(f"{args.steps} steps, {args.nproc} ranks, 16 x 256 tokens per step; rank 0's peak RSS (MiB):")
    print(f"{'token file':>12} {'after step 1':>14} {'after step ' + str(args.steps):>16} {'growth':>8}")
    for name, r in runs.items():
        print(f"{name:>12} {r['first']:>14.1f} {r['last']:>16.1f} {r['last'] - r['first']:>8.1f}")
    small_r, large_r = runs["1 MiB"], runs[f"{args.gib:g} GiB"]
    print(f"large file over small file, peak after the last step: {large_r['last'] - small_r['last']:+.1f} MiB")
    print(f"the parent's pass over the {args.gib:g} GiB file: peak RSS +{scan:.1f} MiB")


if __name__ == "__main__":
    main()
