"""``benchmarks/grouped_gemm.py --sweep``: the measured choice ("auto") against every candidate on public MoE shapes.

    python benchmarks/grouped_gemm.py --sweep [--tokens 4096] [--only dsv3,gpt_oss_120b] [--json out.json]
    python benchmarks/grouped_gemm.py --sweep --write-shapes shapes.json   # the list, for `te-dist tune`
    python benchmarks/grouped_gemm.py --summary docs/data/autotune_sweep.json   # a saved sweep's closing lines

Rows: the expert GEMMs of public MoE models (fc1 = the gated up-projection [H -> 2F], fc2 = the
down-projection [F -> H]) at several experts-per-rank counts, with ``--tokens`` tokens per rank
routed top-k (rows per expert = tokens x top_k / experts per rank), each with even group sizes and
with Zipf-skewed ones that leave experts empty (te_dist.tune.zipf_splits), in all three
directions (fwd, dgrad, wgrad).

Columns (ms per call, median over interleaved rounds, as in the rest of grouped_gemm.py):
  auto    te_dist.kernels with measuring on (its first call measured the bucket within
          ``--bucket-ms``, a fresh tuning file per sweep unless ``--tune-dir``; then its calls until
          the bucket settled on live calls, ``settle``, if the first call left it undecided;
          ``--no-settle``: the first call's ranking stands)
  static  te_dist.kernels with measuring off (the static table)
  best    the fastest candidate: every built CUTLASS tile, torch._grouped_mm, the per-expert loop
  torch   torch._grouped_mm (+ the unfused epilogue where one is asked for: none here)
and auto/best, auto/torch; the closing lines (``summary_lines``; ``--summary FILE`` prints them for a
saved sweep) give the wall time of auto's first (measuring) call per bucket, the rows meeting the
per-row goals, the geometric mean of auto/torch (and of static/torch), and the sweep's resolution:
auto against the column of the kernel it picked.

Re-timing (``--confirm-rounds``, default 3x ``--rounds``): a row whose auto falls under 0.97x the best
or torch in the first pass is timed again at once (auto, torch, the column of auto's pick and every
candidate within 5% of the best) in that many interleaved rounds. One pass's columns differ by a few
percent on the same kernel, and the best of eight noisy columns is biased fast (the winner's curse):
the second, longer pass re-measures the winner. Rows keep both passes; the closing lines count each.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from typing import List, NamedTuple

import torch

from te_dist import kernels
from te_dist.backends import autotune, cutlass_backend, loop_backend, torch_backend

__all__ = ["MODELS", "EXPERTS_PER_RANK", "sweep_gemms", "operands", "run_sweep", "add_arguments"]


class Model(NamedTuple):
    name: str
    hidden: int  # H
    ffn: int  # F, per expert (fc1 writes 2F: gate and up)
    num_experts: int
    top_k: int


# Public configs (model cards / config.json of each release).
MODELS = [
    Model("dsv3", 7168, 2048, 256, 8),  # DeepSeek-V3 / R1
    Model("qwen3_30b", 2048, 768, 128, 8),  # Qwen3-30B-A3B
    Model("qwen3_235b", 4096, 1536, 128, 8),  # Qwen3-235B-A22B
    Model("mixtral_8x7b", 4096, 14336, 8, 2),
    Model("mixtral_8x22b", 6144, 16384, 8, 2),
    Model("gpt_oss_20b", 2880, 2880, 32, 4),
    Model("gpt_oss_120b", 2880, 2880, 128, 4),
    Model("dbrx", 6144, 10752, 16, 4),
    Model("llama4_scout", 5120, 8192, 16, 1),
    Model("llama4_maverick", 5120, 8192, 128, 1),
    Model("granite_3b", 1536, 512, 40, 8),  # granite-3.0-3b-a800m
    Model("granite_1b", 1024, 512, 32, 8),  # granite-3.0-1b-a400m
]
EXPERTS_PER_RANK = (4, 8, 16, 32, 64)
MAX_LOCAL_COUNTS = 2  # per model: the two largest counts that divide its experts, to bound the sweep


class Gemm(NamedTuple):
    name: str  # model_fcX_eLOCAL
    num_experts: int  # experts on this rank
    k: int
    n: int
    rows_per_expert: int


def sweep_gemms(tokens: int, only=None) -> List[Gemm]:
    """fc1 and fc2 of every model at its experts-per-rank counts (at most MAX_LOCAL_COUNTS each)."""
    out = []
    for m in MODELS:
        if only and m.name not in only:
            continue
        counts = [e for e in EXPERTS_PER_RANK if e <= m.num_experts and m.num_experts % e == 0]
        if m.num_experts not in counts and m.num_experts <= max(EXPERTS_PER_RANK):
            counts.append(m.num_experts)  # e.g. granite's 40 experts on one rank
        for local in sorted(set(counts))[-MAX_LOCAL_COUNTS:]:
            rows = max(1, tokens * m.top_k // local)
            out.append(Gemm(f"{m.name}_fc1_e{local}", local, m.hidden, 2 * m.ffn, rows))
            out.append(Gemm(f"{m.name}_fc2_e{local}", local, m.ffn, m.hidden, rows))
    return out


def add_arguments(ap) -> None:
    ap.add_argument("--sweep", action="store_true", help="public MoE shapes, auto vs every candidate (module doc of "
                                                         "benchmarks/grouped_gemm_sweep.py)")
    ap.add_argument("--tokens", type=int, default=4096, help="--sweep: tokens per rank (default 4096)")
    ap.add_argument("--bucket-ms", type=float, default=None,
                    help="--sweep: timed ms per bucket for auto's measurement (default: the run's default)")
    ap.add_argument("--tune-dir", default=None, help="--sweep: tuning-file directory (default: a fresh temp dir)")
    ap.add_argument("--write-shapes", default=None, help="--sweep: write the shape list as JSON for "
                                                         "`te-dist tune --shapes` and exit")
    ap.add_argument("--directions", default="fwd,dgrad,wgrad", help="--sweep: comma-separated directions")
    ap.add_argument("--settle-burst", type=int, default=None, help="--sweep: live calls per preconditioning "
                                                                  "while a bucket settles (default: --iters)")
    ap.add_argument("--no-settle", action="store_true", help="--sweep: auto without live settling (the first "
                                                            "call's ranking stands)")
    ap.add_argument("--confirm-rounds", type=int, default=None, help="--sweep: rounds re-timing a row under 0.97x "
                                                                    "best or torch (default 3x --rounds; 0: off)")
    ap.add_argument("--summary", default=None, help="print the closing lines of a saved --sweep --json FILE and exit")


def _write_shapes(gemms, path) -> None:
    rows = [{"direction": "all", "E": g.num_experts, "K": g.k, "N": g.n, "rows_per_expert": g.rows_per_expert,
             "ragged": ragged, "name": g.name} for g in gemms for ragged in (False, True)]
    with open(path, "w") as f:
        json.dump({"shapes": rows}, f, indent=1)
    print(f"wrote {len(rows)} shapes ({len(rows) * 3} GEMMs) to {path}")


def operands(g: Gemm, routing: str, dev):
    """(group sizes, x [T, K], w [E, K, N] (a transposed [E, N, K]), dy [T, N], offsets) of one row;
    routing "even" or "zipf" (te_dist.tune.zipf_splits: skewed, some experts empty)."""
    from te_dist.tune import zipf_splits

    sizes = zipf_splits(g.num_experts, g.rows_per_expert) if routing == "zipf" else [g.rows_per_expert] * g.num_experts
    T = sum(sizes)
    x = torch.randn(T, g.k, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(g.num_experts, g.n, g.k, device=dev, dtype=torch.bfloat16) / g.k ** 0.5).transpose(1, 2)
    dy = torch.randn(T, g.n, device=dev, dtype=torch.bfloat16)
    off = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    return sizes, x, w, dy, off


def open_tiles(ck) -> List[int]:
    """Every bf16 tile config, each direction's library built and opened now (before any timing: auto's
    first measurement times built tiles only, and a library's first load is not a GEMM's cost)."""
    configs = sorted(ck.CONFIGS)
    for direction in ("fwd", "dgrad", "wgrad"):
        for c in configs:
            ck.load(direction, c, False)
    return configs


def candidates(direction, x, w, dy, off, sizes, configs):
    """{column: fn} of every candidate (the tiles the sweep can run, torch, the loop)."""
    E = w.shape[0]
    fns = {}
    if direction == "fwd":
        fns.update({f"c{c}": (lambda c=c: cutlass_backend.forward(x, w, off, config=c)) for c in configs})
        fns["torch"] = lambda: torch_backend.forward(x, w, off)
        fns["loop"] = lambda: loop_backend.forward(x, w, off, group_sizes=sizes)
    elif direction == "dgrad":
        fns.update({f"c{c}": (lambda c=c: cutlass_backend.dgrad(dy, w, off, config=c)) for c in configs})
        fns["torch"] = lambda: torch_backend.dgrad(dy, w, off)
        fns["loop"] = lambda: loop_backend.dgrad(dy, w, off, group_sizes=sizes)
    else:
        fns.update({f"c{c}": (lambda c=c: cutlass_backend.wgrad(x, dy, off, E, config=c)) for c in configs})
        fns["torch"] = lambda: torch_backend.wgrad(x, dy, off, E)
        fns["loop"] = lambda: loop_backend.wgrad(x, dy, off, E, group_sizes=sizes)
    return fns


def _entry(direction, x, w, dy, off, sizes):
    if direction == "fwd":
        return lambda: kernels.grouped_mm_forward(x, w, off, group_sizes=sizes)
    if direction == "dgrad":
        return lambda: kernels.grouped_mm_dgrad(dy, w, off, group_sizes=sizes)
    return lambda: kernels.grouped_mm_wgrad(x, dy, off, num_groups=w.shape[0], group_sizes=sizes)


def _static(fn, settings):
    """``fn`` with measured choices off (the static table), toggled around the call."""

    def call():
        settings.enabled = False
        try:
            return fn()
        finally:
            settings.enabled = True

    return call


def run_sweep(args, bench_interleaved, queued_start) -> None:
    only = set(args.only.split(",")) if args.only else None
    gemms = sweep_gemms(args.tokens, only)
    if args.write_shapes:
        _write_shapes(gemms, args.write_shapes)
        return
    dev = torch.device("cuda")
    ck = cutlass_backend.kernels_module()
    tune_dir = args.tune_dir or tempfile.mkdtemp(prefix="te_dist_sweep_tune_")
    autotune.reset()
    settings = autotune.configure(enabled=True, directory=tune_dir, total_ms=float("inf"),
                                  bucket_ms=args.bucket_ms, settle_live=not args.no_settle)
    cutlass_ok = "cutlass" in kernels.available_backends(dev)
    configs = open_tiles(ck) if cutlass_ok else []
    # cuBLAS's own start (~100 ms on its first GEMM) is paid by a training process's dense layers
    # and router before its first expert GEMM: not by the first bucket here
    torch.mm(torch.ones(64, 64, device=dev, dtype=torch.bfloat16), torch.ones(64, 64, device=dev, dtype=torch.bfloat16))
    directions = [d for d in args.directions.split(",") if d]
    print(f"# sweep: {len(gemms)} expert GEMM shapes x (even, zipf) x {directions}, {args.tokens} tokens per rank; "
          f"auto measured within {settings.bucket_ms:g} ms per bucket (tuning file in {tune_dir})")
    hdr = (f"{'shape':<28}{'dir':<6}{'routing':<7}{'auto':>9}{'static':>9}{'best':>9} {'best is':<8}{'torch':>9}"
           f"{'auto/best':>10}{'auto/torch':>11}  auto pick")
    print(hdr)
    rows = []
    for g in gemms:
        for routing in ("even", "zipf"):
            sizes, x, w, dy, off = operands(g, routing, dev)
            for direction in directions:
                fns = candidates(direction, x, w, dy, off, sizes, configs)
                auto = _entry(direction, x, w, dy, off, sizes)
                torch.cuda.synchronize()
                tuner = autotune.tuner()
                table = tuner.table_for(torch.cuda.current_device())
                keys_before = set(table.ranking)
                loop_ms_per_new = tuner.loop_plans.ms_per_new[direction]  # what the loop's first call was predicted at
                charged, t0, tuner.last_miss_ms = tuner.budget.spent_ms, time.perf_counter(), None
                auto()  # the first call measures the bucket (outside the timed rounds)
                torch.cuda.synchronize()
                first_ms = (time.perf_counter() - t0) * 1e3
                tune_wall_ms = tuner.last_miss_ms or 0.0
                charged_miss = tuner.budget.spent_ms - charged
                settle_calls = settle(auto, table, queued_start, args.settle_burst or args.iters)
                tune_ms, settle_ms = tuner.budget.spent_ms - charged, tuner.budget.spent_ms - charged - charged_miss
                fns["auto"], fns["static"] = auto, _static(auto, settings)
                t = bench_interleaved(fns, args.warmup, args.iters, args.rounds)
                cands = {k: v for k, v in t.items() if k not in ("auto", "static")}
                best = min(cands, key=cands.get)
                pick = kernels.describe_choice(direction, dy if direction == "dgrad" else x, w, group_sizes=sizes)
                row = {"shape": g.name, "direction": direction, "routing": routing, "E": g.num_experts, "K": g.k,
                       "N": g.n, "rows_per_expert": g.rows_per_expert, "sizes": sizes, "ms": t, "best": best,
                       "auto_pick": pick, "first_call_ms": first_ms, "tune_ms": tune_ms,
                       "tune_wall_ms": tune_wall_ms, "settle_calls": settle_calls, "settle_ms": settle_ms,
                       "loop_ms_per_new_shape": loop_ms_per_new,
                       "tuned_ms": {autotune.key_text(k): table.ms.get(k) for k in set(table.ranking) - keys_before},
                       "auto_over_best": t["auto"] / t[best], "auto_over_torch": t["auto"] / t["torch"],
                       "static_over_torch": t["static"] / t["torch"]}
                again = _confirm_rounds(args)
                if again and _flagged(row):
                    row["confirm"] = confirm(fns, t, best, _column(pick), bench_interleaved, args, again)
                rows.append(row)
                print(f"{g.name:<28}{direction:<6}{routing:<7}{t['auto']:9.4f}{t['static']:9.4f}{t[best]:9.4f} "
                      f"{best:<8}{t['torch']:9.4f}{row['auto_over_best']:10.3f}{row['auto_over_torch']:11.3f}  {pick}"
                      + (_confirm_text(row["confirm"]) if "confirm" in row else ""), flush=True)
                _write_json(args, settings, rows, complete=False)
            del x, w, dy
            torch.cuda.empty_cache()
    _write_json(args, settings, rows, complete=True)
    print("\n" + "\n".join(summary_lines(rows)))


GOAL = 0.97  # auto's per-row goal against the best candidate and torch (speed ratio)
CONFIRM_NEAR = 1.05  # re-timing takes every candidate the first pass put within this of the best
CONFIRM_SAMPLE_MS = 20.0  # GEMM time per re-timed sample at most (fewer calls per sample for long GEMMs)


def _confirm_rounds(args) -> int:
    return 3 * args.rounds if args.confirm_rounds is None else args.confirm_rounds


def _flagged(row) -> bool:
    return row["auto_over_best"] > 1 / GOAL or row["auto_over_torch"] > 1 / GOAL


def confirm(fns, t, best, pick_column, bench_interleaved, args, rounds) -> dict:
    """Auto, torch, auto's pick and the candidates near the first pass's best, timed again in ``rounds``
    interleaved rounds: {"rounds", "iters", "ms", "best", "auto_over_best", "auto_over_torch"}."""
    names = {"auto", "torch", best} | {n for n in (pick_column,) if n in fns}
    names |= {n for n, v in t.items() if n not in ("auto", "static") and v <= CONFIRM_NEAR * t[best]}
    iters = max(2, min(args.iters, int(CONFIRM_SAMPLE_MS / max(t[best], 1e-3))))
    ms = bench_interleaved({n: fns[n] for n in sorted(names)}, args.warmup, iters, rounds)
    cands = {n: v for n, v in ms.items() if n != "auto"}
    again = min(cands, key=cands.get)
    return {"rounds": rounds, "iters": iters, "ms": ms, "best": again,
            "auto_over_best": ms["auto"] / ms[again], "auto_over_torch": ms["auto"] / ms["torch"]}


def _confirm_text(c) -> str:
    return f"  | again ({c['rounds']} rounds): auto/best {c['auto_over_best']:.3f} ({c['best']}), auto/torch " \
           f"{c['auto_over_torch']:.3f}"


def _final(row) -> dict:
    """The row's verdict ratios: the re-timed pass where there is one."""
    return row.get("confirm", row)


SETTLE_CALLS = 400  # at most, per bucket (it settles within a few dozen)
SETTLE_HEAT = 6  # preconditioning samples' GEMMs (~9 ms each) before a bucket's first live calls


def settle(auto, table, queued_start, burst: int) -> int:
    """Calls of ``auto`` until its bucket is no longer settling on live calls; returns how many.
    They are queued in bursts of ``burst`` calls behind the same preconditioning GEMMs as a timed
    sample (``queued_start``: a training step's dense work, the host ahead of the GPU), the first
    burst behind SETTLE_HEAT of them: the live calls run in the power state the columns are timed in
    (the GPU idled while the row's operands were made; from idle the H200 reaches its power limit
    after 25-40 ms of GEMMs, docs/kernels.md), as a training step's calls do."""
    calls = 0
    while table.settling and calls < SETTLE_CALLS:
        if calls % burst == 0:
            torch.cuda.synchronize()
            for _ in range(SETTLE_HEAT if calls == 0 else 1):
                queued_start()
        auto()
        calls += 1
    torch.cuda.synchronize()
    return calls


def _column(pick: str) -> str:
    """The candidate column of a pick such as "cutlass:2 measured" (c2), "torch static" (torch)."""
    name = pick.split()[0]
    return "c" + name.split(":")[1] if name.startswith("cutlass:") else name


def _quantile(values, q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary_lines(rows) -> List[str]:
    """The sweep's closing lines: first-call wall time, the per-row goals, the geomean, and the sweep's
    own resolution: auto against the candidate column of the kernel it picked (the same kernel, timed
    in the same rounds), whose spread bounds what one row's ratio can tell."""
    firsts = [r["first_call_ms"] for r in rows]
    walls = [r["tune_wall_ms"] + r.get("settle_ms", 0.0) for r in rows if "tune_wall_ms" in r]
    settled = [r for r in rows if r.get("settle_calls")]
    to_torch = [r["auto_over_torch"] for r in rows]
    same = [r["ms"]["auto"] / r["ms"][_column(r["auto_pick"])] for r in rows if _column(r["auto_pick"]) in r["ms"]]
    measuring = ([f"measuring a bucket (wall ms from the miss to the choice, the file write included, plus live "
                  f"settling's charge): median {_quantile(walls, 0.5):.1f}, p90 {_quantile(walls, 0.9):.1f}, max "
                  f"{max(walls):.1f}; over {sum(w > 50 for w in walls)} of {len(walls)} rows past 50 ms"] if walls else [])
    if settled:
        measuring.append(
            f"settled on live calls: {len(settled)} rows, calls median {_quantile([r['settle_calls'] for r in settled], 0.5)}"
            f", max {max(r['settle_calls'] for r in settled)}; charged ms (regret + file write) median "
            f"{_quantile([r['settle_ms'] for r in settled], 0.5):.1f}, max {max(r['settle_ms'] for r in settled):.1f}")
    return [
        f"first call of a bucket (measuring, then the call itself, wall ms): median {_quantile(firsts, 0.5):.1f}, p90 "
        f"{_quantile(firsts, 0.9):.1f}, max {max(firsts):.1f}; all first calls together {sum(firsts) / 1e3:.2f} s",
        *measuring,
        f"rows with auto >= 0.97x the best candidate: {sum(r['auto_over_best'] <= 1 / GOAL for r in rows)} of "
        f"{len(rows)} (worst {1 / max(r['auto_over_best'] for r in rows):.2f}x); >= 0.97x torch: "
        f"{sum(v <= 1 / GOAL for v in to_torch)} (worst {1 / max(to_torch):.2f}x)",
        *_confirm_lines(rows),
        f"geomean auto/torch over {len(rows)} GEMMs: {_geomean(to_torch):.3f} (static/torch: "
        f"{_geomean([r['static_over_torch'] for r in rows]):.3f}); auto slower than torch in "
        f"{sum(v > 1 for v in to_torch)} rows",
        f"resolution: auto's ms over its own kernel's column, p5 / median / p95 {_quantile(same, 0.05):.3f} / "
        f"{_quantile(same, 0.5):.3f} / {_quantile(same, 0.95):.3f} over {len(same)} rows",
    ]


def _confirm_lines(rows) -> List[str]:
    again = [r for r in rows if "confirm" in r]
    if not again:
        return []
    final = [_final(r) for r in rows]
    held = [r for r in again if not _flagged(r["confirm"])]
    return [f"re-timed ({again[0]['confirm']['rounds']} rounds) the {len(again)} rows under 0.97x: {len(held)} reach "
            f"0.97x of both; after it, auto >= 0.97x the best in {sum(f['auto_over_best'] <= 1 / GOAL for f in final)} "
            f"of {len(rows)} (worst {1 / max(f['auto_over_best'] for f in final):.2f}x), >= 0.97x torch in "
            f"{sum(f['auto_over_torch'] <= 1 / GOAL for f in final)} (worst "
            f"{1 / max(f['auto_over_torch'] for f in final):.2f}x)"]


def print_summary(path) -> None:
    """``--summary FILE``: the closing lines of a saved sweep (no GPU needed)."""
    with open(path) as f:
        data = json.load(f)
    print(f"{path}: {data['meta']}")
    print("\n".join(summary_lines(data["sweep"])))


def _geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def _write_json(args, settings, rows, *, complete: bool) -> None:
    """The rows so far (``--json``), rewritten after every row: a sweep cut short keeps what it measured."""
    if not args.json:
        return
    meta = {"hardware": f"1 x {torch.cuda.get_device_name()}", "torch": torch.__version__, "dtype": "bfloat16",
            "tokens_per_rank": args.tokens, "bucket_ms": settings.bucket_ms, "iters": args.iters,
            "rounds": args.rounds, "warmup": args.warmup, "complete": complete,
            "confirm_rounds": _confirm_rounds(args)}
    tmp = f"{args.json}.tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "sweep": rows,
                   "geomean_auto_over_torch": _geomean([r["auto_over_torch"] for r in rows]),
                   "geomean_static_over_torch": _geomean([r["static_over_torch"] for r in rows])}, f, indent=1)
    os.replace(tmp, args.json)
