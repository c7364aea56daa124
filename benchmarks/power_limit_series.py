"""Grouped-GEMM candidates under sustained load: per-call ms of tiles 0, 2, 3 and torch._grouped_mm
queued back to back (one event per call, one sync at the end), over ~60 ms of GPU work.

    python benchmarks/power_limit_series.py

Why: the autotuner (te_dist/backends/autotune.py) has 50 ms per shape bucket, and the sweep's
timing (benchmarks/grouped_gemm.py) runs every sample behind preconditioning GEMMs. This shows how
long back-to-back GEMMs take to bring the GPU to its power limit and how that reorders candidates.
Starts: after 0.3 s idle; behind six 8192^3 GEMMs (heavy8); behind twelve 4096^3 (heavy3); behind a
20 ms GPU sleep; and with a sync after every call (sync_each). Each line: the first four calls and
the mean of each sixth of the series, per candidate. Rows: three sweep shapes whose best candidate
differed between the tuner and the sweep (H200, 2026-12-02).
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouped_gemm_sweep import candidates, open_tiles, operands, sweep_gemms  # noqa: E402

from te_dist.backends import cutlass_backend  # noqa: E402

ROWS = [("gpt_oss_20b_fc1_e32", "fwd", "zipf"), ("qwen3_30b_fc2_e64", "dgrad", "even"),
        ("dsv3_fc2_e32", "dgrad", "zipf")]
NAMES = ["c0", "c2", "torch", "c3"]
STARTS = [(None, False), ("heavy8", False), ("heavy3", False), ("sleep", False), (None, True), ("heavy8", True)]


def series(fns, n, pre, sync_each, heat):
    """{candidate: per-call ms} of ``n`` calls cycling through NAMES after the start ``pre``."""
    torch.cuda.synchronize()
    time.sleep(0.3)
    if pre == "heavy8":
        for _ in range(6):
            torch.mm(heat[0], heat[0])
    elif pre == "heavy3":
        for _ in range(12):
            torch.mm(heat[1], heat[1])
    elif pre == "sleep":
        torch.cuda._sleep(20_000_000)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    seq = [NAMES[i % len(NAMES)] for i in range(n)]
    for i, name in enumerate(seq):
        fns[name]()
        ev[i + 1].record()
        if sync_each:
            ev[i + 1].synchronize()
    torch.cuda.synchronize()
    t = [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]
    return {name: [round(t[i], 3) for i in range(n) if seq[i] == name] for name in NAMES}


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda")
    ck = cutlass_backend.kernels_module()
    configs = open_tiles(ck)
    gemms = {g.name: g for g in sweep_gemms(4096)}
    heat = (torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16),
            torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16))
    print(f"# {torch.cuda.get_device_name()}: per-call ms, back to back")
    for name, direction, routing in ROWS:
        g = gemms[name]
        sizes, x, w, dy, off = operands(g, routing, dev)
        fns = candidates(direction, x, w, dy, off, sizes, configs)
        for f in fns.values():
            f()
        per_call = 0.2 if g.rows_per_expert * g.num_experts * g.k * g.n < 2e11 else 1.0
        n = int(60 / per_call) // len(NAMES) * len(NAMES)
        for pre, sync_each in STARTS:
            s = series(fns, n, pre, sync_each, heat)
            print(f"{name} {direction} {routing} start {pre or 'idle'}{' sync_each' if sync_each else ''}")
            for cand in NAMES:
                v = s[cand]
                k = -(-len(v) // 6)
                means = [round(sum(v[i:i + k]) / len(v[i:i + k]), 3) for i in range(0, len(v), k)]
                print(f"   {cand:6s} first {v[:4]} sixths {means}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
