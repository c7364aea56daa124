"""How long `te-dist` keeps a user waiting: time to the first output line, to the first step, and to exit.

Each case is the real console command (``python -m te_dist.cli``, what the `te-dist` script calls)
in a fresh temporary directory; every line of its output (stdout and stderr together) is
time-stamped as it arrives. Medians over ``--repeats`` runs; the machine's load is printed with
the table because a shared machine shifts every figure.

    python benchmarks/cli_latency.py                   # --help, --version, train --print-config, train (2 CPU ranks, 3 steps)
    python benchmarks/cli_latency.py --repeats 5 --steps 3
    python benchmarks/cli_latency.py --repo ../other-checkout   # the same cases against another checkout

A case the checkout does not support (its command exits non-zero) is shown as "fails".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import timing

REPO = timing.REPO


def time_command(args, *, repo: Path = REPO, step_marker: str = "step ") -> dict:
    """Run ``te-dist *args`` from ``repo``; seconds to the first line, to the first line starting with
    ``step_marker``, to exit; None when the command fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="te_dist_latency_") as cwd:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "te_dist.cli", *args], cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)
        first = first_step = last_line = None
        lines = []
        for line in proc.stdout:
            now = time.perf_counter() - t0
            lines.append(line)
            first = now if first is None else first
            if first_step is None and line.startswith(step_marker):
                first_step = now
            last_line = now
        code = proc.wait()
        exit_s = time.perf_counter() - t0
    if code != 0:
        print(f"te-dist {' '.join(args)} exited {code}:\n{''.join(lines)[-2000:]}", file=sys.stderr)
        return None
    return {"first_line": first, "first_step": first_step, "last_line": last_line, "exit": exit_s}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _cell(value) -> str:
    return f"{value:>12.2f}" if value is not None else f"{'-':>12}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps of the `train` case")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose te_dist runs (default: this one)")
    timing.add_json_option(parser)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    train = ["train", "--nproc", str(args.nproc), "--steps", str(args.steps), "--no-checkpoint", "--device", "cpu"]
    cases = [
        ("te-dist --help", ["--help"]),
        ("te-dist --version", ["--version"]),
        ("te-dist train --help", ["train", "--help"]),
        ("te-dist train --print-config", [*train, "--print-config"]),
        (f"te-dist train ({args.nproc} CPU ranks, {args.steps} steps)", train),
    ]
    load_before = os.getloadavg()[0]
    rows = []
    for name, cmd in cases:
        runs = [time_command(cmd, repo=args.repo.resolve()) for _ in range(args.repeats)]
        ok = [r for r in runs if r is not None]
        rows.append((name, {k: _median([r[k] for r in ok]) for k in ok[0]} if ok else None))
    load = os.getloadavg()[0]
    print(f"te-dist latency ({args.repo.resolve()}): median of {args.repeats} runs, seconds from process start "
          f"({os.cpu_count()} CPUs, load average {load_before:.1f} before, {load:.1f} after)")
    print(f"{'command':<40}{'first line':>12}{'first step':>12}{'last line':>12}{'exit':>12}")
    for name, row in rows:
        cells = "".join(_cell(row[k]) for k in ("first_line", "first_step", "last_line", "exit")) if row else f"{'fails':>12}"
        print(f"{name:<40}{cells}")
    timing.write_json(args.json, [dict(command=name, **(row or {"fails": True})) for name, row in rows],
                      repo=str(args.repo.resolve()), load_before=load_before, load_after=load, benchmark="cli_latency")
    return 0


if __name__ == "__main__":
    sys.exit(main())
