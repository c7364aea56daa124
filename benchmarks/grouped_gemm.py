"""bf16 grouped GEMMs on one GPU: our CUTLASS tiles against torch._grouped_mm and cuBLAS per expert.

    python benchmarks/grouped_gemm.py [--rounds 5] [--json PATH] [--skip-backward]   # the model shapes
    python benchmarks/grouped_gemm.py --only layer       # the MoE-layer shapes of benchmarks/moe_layer.py
    python benchmarks/grouped_gemm.py --ragged [--seed 300]   # those rows with router-like group sizes
    python benchmarks/grouped_gemm.py --only small_m_E64 --candidates 11,12   # candidate tiles too
    python benchmarks/grouped_gemm.py --sweep [--only dsv3,mixtral_8x7b] [--json PATH]   # measured choices
    python benchmarks/grouped_gemm.py --sweep --write-shapes FILE   # the sweep's shapes, for `te-dist tune`
    python benchmarks/grouped_gemm.py --summary docs/data/autotune_sweep.json   # a saved sweep's summary

Tables (TFLOP/s): cN = CUTLASS tile config N, ``cut`` = the tile table's pick from the shape alone,
``auto`` = ``te_dist.kernels`` (validation + backend selection), ``loop`` = cuBLAS per expert, then
auto/best (best = any column) and cut/torch with its geometric mean over the six model shapes; dgrad and
wgrad tables; host µs to queue one forward; the fused bias + row-scale epilogue against the GEMM with
separate kernels. Every sample starts behind the same dense GEMMs (timing.queued_start), so the
host runs ahead as in training and every variant starts from the same power state; the variants of
one shape run in interleaved rounds (timing.interleaved_ms), the median of --rounds reported.

``--ragged`` times the GEMMs of benchmarks/moe_layer.py's rows with the group sizes a router gives
(seeded: expert shares softmax(0.2 * randn), rows drawn multinomially; a grouped kernel pads every
group to whole tiles, so equal splits flatter it), ``auto`` given the sizes on the host, and sums the
six GEMMs of one layer step per column.

``--sweep``: the expert GEMMs of public MoE models (fc1 [H -> 2F], fc2 [F -> H]) at their two largest
experts-per-rank counts, ``--tokens`` per rank routed top-k, even and Zipf-skewed group sizes
(te_dist.tune.zipf_splits), fwd/dgrad/wgrad. Columns, ms: ``auto`` (measured choices on: its first
call measures the bucket in a fresh tuning file, then its calls until the bucket settles on live
calls), ``static`` (measured choices off), ``best`` (the fastest of every tile, torch, the loop) and
``torch``. A row under 0.97x the best or torch is timed again at once in --confirm-rounds rounds
(auto, torch, auto's pick, the candidates within 5% of the best): the best of many noisy columns is
biased fast. Closing lines: the first call's wall time per bucket, the rows meeting the goals, the
geomean of auto/torch, and auto against the column of the kernel it picked (the sweep's resolution).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import List, NamedTuple

import torch

import timing

SHAPES = [  # name, E, rows per expert, K, N
    ("mixtral_fc1", 8, 4096, 4096, 28672),
    ("mixtral_fc2", 8, 4096, 14336, 4096),
    ("dsv3_fc1_ep8", 32, 1024, 7168, 4096),
    ("dsv3_fc2_ep8", 32, 1024, 2048, 7168),
    ("qwen3_fc1", 128, 256, 2048, 1536),
    ("small_m_E64", 64, 128, 4096, 2048),
]
DECODE = [  # name, E, total rows (spread evenly), K, N
    ("decode_E8_T64", 8, 64, 4096, 14336),
    ("decode_E64_T256", 64, 256, 2048, 1536),
]
LAYER = [  # the GEMMs of benchmarks/moe_layer.py's rows, uniform routing: name, E, rows per expert, K, N
    ("ds_layer_fc1_256", 64, 256, 7168, 4096),
    ("ds_layer_fc2_256", 64, 256, 2048, 7168),
    ("mx_layer_fc1_1024", 4, 1024, 4096, 28672),
    ("mx_layer_fc2_1024", 4, 1024, 14336, 4096),
]
LAYER_ROWS = [  # --ragged: name, experts, local experts, rows routed over all ranks, hidden, ffn
    ("mx_ep2_2048", 8, 4, 2 * 2048 * 2, 4096, 14336),
    ("mx_ep1_2048", 8, 8, 2048 * 2, 4096, 14336),
    ("mx_ep2_8192", 8, 4, 2 * 8192 * 2, 4096, 14336),
    ("mx_ep1_8192", 8, 8, 8192 * 2, 4096, 14336),
    ("ds_ep2_1024", 64, 32, 2 * 1024 * 8, 7168, 2048),
    ("ds_ep1_1024", 64, 64, 1024 * 8, 7168, 2048),
    ("ds_ep2_2048", 64, 32, 2 * 2048 * 8, 7168, 2048),
    ("ds_ep1_8192", 64, 64, 8192 * 8, 7168, 2048),
]
DIRECTIONS = ("fwd", "dgrad", "wgrad")


def router_like_splits(seed, experts, local, rows):
    """Rows of this rank's ``local`` experts when ``rows`` token copies are routed with skewed shares."""
    g = torch.Generator().manual_seed(seed)
    shares = torch.softmax(0.2 * torch.randn(experts, generator=g), 0)
    picks = torch.multinomial(shares, rows, replacement=True, generator=g)
    return picks.bincount(minlength=experts)[:local].tolist()


def ragged_cases(seed=100):
    """(name, E, splits, K, N) for fc1 and fc2 of every LAYER_ROWS row (row i uses seed + i)."""
    cases = []
    for i, (name, E, El, rows, H, F) in enumerate(LAYER_ROWS):
        splits = router_like_splits(seed + i, E, El, rows)
        cases += [(f"{name}_fc1", El, splits, H, 2 * F), (f"{name}_fc2", El, splits, F, H)]
    return cases


def operands(E, splits, K, N, dev="cuda"):
    """(x [T, K], w [E, K, N] (a transposed [E, N, K]), dy [T, N], int32 offsets) in bf16."""
    T = sum(splits)
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5).transpose(1, 2)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    return x, w, dy, torch.tensor(splits, device=dev).cumsum(0).to(torch.int32)


def columns(direction, x, w, dy, off, splits, tiles) -> dict:
    """{column: fn}: every tile in ``tiles`` (cN), torch._grouped_mm and cuBLAS per expert (sizes on the host)."""
    from te_dist.backends import cutlass_backend, loop_backend, torch_backend

    E = w.shape[0]
    if direction == "fwd":
        fns = {f"c{c}": (lambda c=c: cutlass_backend.forward(x, w, off, config=c)) for c in tiles}
        fns["torch"] = lambda: torch_backend.forward(x, w, off)
        fns["loop"] = lambda: loop_backend.forward(x, w, off, group_sizes=splits)
    elif direction == "dgrad":
        fns = {f"c{c}": (lambda c=c: cutlass_backend.dgrad(dy, w, off, config=c)) for c in tiles}
        fns["torch"] = lambda: torch_backend.dgrad(dy, w, off)
        fns["loop"] = lambda: loop_backend.dgrad(dy, w, off, group_sizes=splits)
    else:
        fns = {f"c{c}": (lambda c=c: cutlass_backend.wgrad(x, dy, off, E, config=c)) for c in tiles}
        fns["torch"] = lambda: torch_backend.wgrad(x, dy, off, E)
        fns["loop"] = lambda: loop_backend.wgrad(x, dy, off, E, group_sizes=splits)
    return fns


def entry(direction, x, w, dy, off, sizes):
    """The public entry point of ``direction`` (``sizes``: host group sizes or None)."""
    from te_dist import kernels

    if direction == "fwd":
        return lambda: kernels.grouped_mm_forward(x, w, off, group_sizes=sizes)
    if direction == "dgrad":
        return lambda: kernels.grouped_mm_dgrad(dy, w, off, group_sizes=sizes)
    return lambda: kernels.grouped_mm_wgrad(x, dy, off, num_groups=w.shape[0], group_sizes=sizes)


def heuristic(direction, x, w, dy, off):
    """Our CUTLASS kernel on the tile table's pick."""
    from te_dist.backends import cutlass_backend

    if direction == "fwd":
        return lambda: cutlass_backend.forward(x, w, off)
    if direction == "dgrad":
        return lambda: cutlass_backend.dgrad(dy, w, off)
    return lambda: cutlass_backend.wgrad(x, dy, off, w.shape[0])


def candidate_ids(ck, spec):
    """The candidate tiles ``--candidates`` names: none, "all", or comma-separated ids."""
    if spec is None:
        return []
    if spec == "all":
        return sorted(ck.CANDIDATES)
    ids = [int(c) if c.strip().isdigit() else c for c in spec.split(",")]
    unknown = [c for c in ids if c not in ck.CANDIDATES]
    if unknown:
        raise SystemExit(f"--candidates expects ids of cutlass_kernels.CANDIDATES {sorted(ck.CANDIDATES)}, "
                         f"received {unknown}")
    return ids


def shape_cases(args):
    cases = [(n, E, [m] * E, K, N) for n, E, m, K, N in SHAPES]
    for n, E, T, K, N in DECODE:
        base, extra = divmod(T, E)
        cases.append((n, E, [base + (i < extra) for i in range(E)], K, N))
    wanted = set(args.only.split(",")) if args.only else None
    if args.ragged:  # --only names LAYER_ROWS rows (both GEMMs) or single GEMMs, e.g. mx_ep2_2048_fc1
        return [c for c in ragged_cases(args.seed) if not wanted or {c[0], c[0].rsplit("_", 1)[0]} & wanted]
    if wanted:
        if "layer" in wanted:
            wanted |= {s[0] for s in LAYER}
        cases = [c for c in cases + [(n, E, [m] * E, K, N) for n, E, m, K, N in LAYER] if c[0] in wanted]
    return cases


def tables(args) -> dict:
    from te_dist import kernels
    from te_dist.backends import cutlass_backend, epilogue, torch_backend

    ck = cutlass_backend.kernels_module()
    tiles = sorted(ck.CONFIGS) + candidate_ids(ck, args.candidates)
    cases = shape_cases(args)
    auto_sizes = (lambda splits: splits) if args.ragged else (lambda splits: None)
    timed = dict(iters=args.iters, warmup=args.warmup, rounds=args.rounds)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dense = timing.cuda_ms(lambda: a @ a, iters=10, warmup=5)  # also brings the clocks up
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; median of {args.rounds} interleaved rounds of "
          f"{args.iters} calls; dense bf16 8192^3: {2 * 8192 ** 3 / dense / 1e9:.0f} TFLOP/s")
    results = {"forward": [], "backward": [], "epilogue": [], "host_us": []}  # plots.py reads "forward"
    tile_cols = "".join(f"{'c' + str(c):>8}" for c in tiles)
    directions = ("fwd",) if args.skip_backward else DIRECTIONS
    geo = []
    for direction in directions:
        print(f"\n## {direction} bf16, TFLOP/s\n{'shape':<18}{tile_cols}{'cut':>8}{'torch':>8}{'loop':>8}{'auto':>8} "
              f"{'pick':<10}{'best':<7}{'auto/best':>10}{'cut/torch':>10}")
        for name, E, splits, K, N in cases:
            x, w, dy, off = operands(E, splits, K, N)
            fns = columns(direction, x, w, dy, off, splits, tiles)
            fns["cutlass"] = heuristic(direction, x, w, dy, off)
            fns["auto"] = entry(direction, x, w, dy, off, auto_sizes(splits))
            if direction == "fwd":  # a fast wrong kernel must not win
                ref = torch_backend.forward(x, w, off).float()
                wrong = [c for c in tiles if (fns[f"c{c}"]().float() - ref).norm() > 1e-2 * ref.norm()]
                if wrong:
                    print(f"# {name}: configs {wrong} disagree with torch._grouped_mm (relative error > 1e-2)")
            t = timing.interleaved_ms(fns, **timed)
            tf = {k: 2.0 * sum(splits) * K * N / v / 1e9 for k, v in t.items()}
            pick = kernels.describe_choice(direction, dy if direction == "dgrad" else x, w,
                                           group_sizes=auto_sizes(splits))
            best = max((k for k in tf if k != "auto"), key=tf.get)
            ratio = tf["cutlass"] / tf["torch"]
            if direction == "fwd" and name in {s[0] for s in SHAPES}:
                geo.append(ratio)
            print(f"{name:<18}" + "".join(f"{tf[f'c{c}']:8.1f}" for c in tiles) + f"{tf['cutlass']:8.1f}"
                  f"{tf['torch']:8.1f}{tf['loop']:8.1f}{tf['auto']:8.1f} {pick.split()[0]:<10}{best:<7}"
                  f"{tf['auto'] / tf[best]:10.3f}{ratio:10.3f}", flush=True)
            row = {"shape": name, "direction": direction, "tflops": tf, "ms": t, "pick": pick}
            results["forward" if direction == "fwd" else "backward"].append(row)
            del x, w, dy
            torch.cuda.empty_cache()
    if len(geo) == len(SHAPES):
        results["geomean_cutlass_over_torch"] = timing.geomean(geo)
        print(f"geomean cut/torch over the six model shapes: {results['geomean_cutlass_over_torch']:.3f}")
    if args.ragged and not args.skip_backward:
        print_step_sums(results)

    print(f"\n## host µs to queue one forward (cut: our kernel; auto: validation + selection + kernel)\n"
          f"{'shape':<18}{'cut':>8}{'auto':>8}{'torch':>8}")
    for name, E, splits, K, N in cases:
        x, w, dy, off = operands(E, splits, K, N)
        h = {k: timing.busy_host_us(fn) for k, fn in (("cut", heuristic("fwd", x, w, dy, off)),
                                                       ("auto", entry("fwd", x, w, dy, off, auto_sizes(splits))),
                                                       ("torch", lambda: torch_backend.forward(x, w, off)))}
        print(f"{name:<18}{h['cut']:8.1f}{h['auto']:8.1f}{h['torch']:8.1f}")
        results["host_us"].append({"shape": name, **h})

    print(f"\n## fused bias + row-scale epilogue, ms (ratio = unfused / fused)\n"
          f"{'shape':<18}{'fused':>9}{'cut+sep':>9}{'torch+sep':>10}{'vs cut+sep':>11}{'vs torch+sep':>13}")
    for name, E, m, K, N in SHAPES:
        if name not in {c[0] for c in cases}:
            continue
        x, w, _, off = operands(E, [m] * E, K, N)
        bias, scale = torch.randn(E, N, device="cuda"), torch.rand(x.shape[0], device="cuda")
        ms = {k: timing.cuda_ms(fn, iters=args.iters, warmup=args.warmup, precondition=True) for k, fn in (
            ("fused", lambda: cutlass_backend.forward(x, w, off, bias, scale)),
            ("cut_sep", lambda: epilogue.apply_epilogue(cutlass_backend.forward(x, w, off), off, bias, scale,
                                                        torch.bfloat16)),
            ("torch_sep", lambda: torch_backend.forward(x, w, off, bias, scale)))}
        print(f"{name:<18}{ms['fused']:9.3f}{ms['cut_sep']:9.3f}{ms['torch_sep']:10.3f}"
              f"{ms['cut_sep'] / ms['fused']:11.3f}{ms['torch_sep'] / ms['fused']:13.3f}")
        results["epilogue"].append({"shape": name, "fused_ms": ms["fused"], "cutlass_sep_ms": ms["cut_sep"],
                                    "torch_sep_ms": ms["torch_sep"]})
        torch.cuda.empty_cache()
    timing.write_json(args.json, results, dtype="bfloat16", benchmark="grouped_gemm")
    return results


def print_step_sums(results):
    """--ragged: the six GEMMs of one layer step (fc1 and fc2 in every direction) summed per column."""
    cols = ("auto", "cutlass", "torch", "loop", "best")
    print("\n## six GEMMs of one MoE-layer step, ragged group sizes, ms (best = the fastest column of each GEMM)")
    print(f"{'row':<14}" + "".join(f"{c:>9}" for c in cols) + f"{'best/auto':>10}{'cut/auto':>10}")
    sums = {}
    for entry_ in results["forward"] + results["backward"]:
        ms = entry_["ms"]
        acc = sums.setdefault(entry_["shape"].rsplit("_", 1)[0], dict.fromkeys(cols, 0.0))
        for c in cols[:-1]:
            acc[c] += ms[c]
        acc["best"] += min(v for k, v in ms.items() if k != "auto")
    for row, acc in sums.items():
        print(f"{row:<14}" + "".join(f"{acc[c]:9.3f}" for c in cols)
              + f"{acc['best'] / acc['auto']:10.3f}{acc['cutlass'] / acc['auto']:10.3f}")


# ------------------------------------------------------------------------------------------ --sweep
class Model(NamedTuple):
    name: str
    hidden: int  # H
    ffn: int  # F, per expert (fc1 writes 2F: gate and up)
    num_experts: int
    top_k: int


MODELS = [  # public configs (model cards / config.json of each release)
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
MAX_LOCAL_COUNTS = 2  # per model: the two largest counts that divide its experts
GOAL = 0.97  # auto's per-row goal against the best candidate and torch (speed ratio)
CONFIRM_NEAR = 1.05  # re-timing takes every candidate the first pass put within this of the best
CONFIRM_SAMPLE_MS = 20.0  # GEMM time per re-timed sample at most
SETTLE_CALLS = 400  # at most, per bucket
SETTLE_HEAT = 6  # preconditioning samples before a bucket's first live calls


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
            out += [Gemm(f"{m.name}_fc1_e{local}", local, m.hidden, 2 * m.ffn, rows),
                    Gemm(f"{m.name}_fc2_e{local}", local, m.ffn, m.hidden, rows)]
    return out


def settle(auto, table, burst: int) -> int:
    """Calls of ``auto`` until its bucket no longer settles on live calls; returns how many. They run in
    bursts of ``burst`` behind the preconditioning GEMMs (the first burst behind SETTLE_HEAT of them), so
    the live calls meet the power state the columns are timed in, as a training step's calls do."""
    calls = 0
    while table.settling and calls < SETTLE_CALLS:
        if calls % burst == 0:
            torch.cuda.synchronize()
            for _ in range(SETTLE_HEAT if calls == 0 else 1):
                timing.queued_start()
        auto()
        calls += 1
    torch.cuda.synchronize()
    return calls


def _static(fn):
    """``fn`` with measured choices off (the static table), switched through the public configure()."""
    from te_dist.backends import autotune

    def call():
        autotune.configure(enabled=False)
        try:
            return fn()
        finally:
            autotune.configure(enabled=True)
    return call


def _column(pick: str) -> str:
    """The candidate column of a pick such as "cutlass:2 measured" (c2), "torch static" (torch)."""
    name = pick.split()[0]
    return "c" + name.split(":")[1] if name.startswith("cutlass:") else name


def _flagged(row) -> bool:
    return row["auto_over_best"] > 1 / GOAL or row["auto_over_torch"] > 1 / GOAL


def confirm(fns, t, best, pick_column, args) -> dict:
    """Auto, torch, auto's pick and the candidates near the first pass's best, timed again."""
    names = {"auto", "torch", best} | {n for n in (pick_column,) if n in fns}
    names |= {n for n, v in t.items() if n not in ("auto", "static") and v <= CONFIRM_NEAR * t[best]}
    iters = max(2, min(args.iters, int(CONFIRM_SAMPLE_MS / max(t[best], 1e-3))))
    ms = timing.interleaved_ms({n: fns[n] for n in sorted(names)}, iters=iters, warmup=args.warmup,
                               rounds=args.confirm_rounds)
    cands = {n: v for n, v in ms.items() if n != "auto"}
    again = min(cands, key=cands.get)
    return {"rounds": args.confirm_rounds, "iters": iters, "ms": ms, "best": again,
            "auto_over_best": ms["auto"] / ms[again], "auto_over_torch": ms["auto"] / ms["torch"]}


def sweep(args) -> list:
    from te_dist import kernels
    from te_dist.backends import autotune, cutlass_backend
    from te_dist.tune import zipf_splits

    gemms = sweep_gemms(args.tokens, set(args.only.split(",")) if args.only else None)
    if args.write_shapes:
        rows = [{"direction": "all", "E": g.num_experts, "K": g.k, "N": g.n, "rows_per_expert": g.rows_per_expert,
                 "ragged": ragged, "name": g.name} for g in gemms for ragged in (False, True)]
        with open(args.write_shapes, "w") as f:
            json.dump({"shapes": rows}, f, indent=1)
        print(f"wrote {len(rows)} shapes ({len(rows) * 3} GEMMs) to {args.write_shapes}")
        return []
    args.confirm_rounds = 3 * args.rounds if args.confirm_rounds is None else args.confirm_rounds
    tune_dir = args.tune_dir or tempfile.mkdtemp(prefix="te_dist_sweep_tune_")
    autotune.reset()
    settings = autotune.configure(enabled=True, directory=tune_dir, total_ms=float("inf"), bucket_ms=args.bucket_ms,
                                  settle_live=not args.no_settle)
    ck = cutlass_backend.kernels_module()
    configs = sorted(ck.CONFIGS) if "cutlass" in kernels.available_backends(torch.device("cuda")) else []
    for direction in DIRECTIONS:  # built and opened before any timing: a library's first load is no GEMM's cost
        for c in configs:
            ck.load(direction, c, False)
    # cuBLAS's own start is paid by a training process's dense layers before its first expert GEMM
    torch.mm(torch.ones(64, 64, device="cuda", dtype=torch.bfloat16), torch.ones(64, 64, device="cuda",
                                                                                  dtype=torch.bfloat16))
    directions = [d for d in args.directions.split(",") if d]
    print(f"# sweep: {len(gemms)} expert GEMM shapes x (even, zipf) x {directions}, {args.tokens} tokens per rank; "
          f"auto measured within {settings.bucket_ms:g} ms per bucket (tuning file in {tune_dir})")
    print(f"{'shape':<28}{'dir':<6}{'routing':<7}{'auto':>9}{'static':>9}{'best':>9} {'best is':<8}{'torch':>9}"
          f"{'auto/best':>10}{'auto/torch':>11}  auto pick")
    rows = []
    for g in gemms:
        for routing in ("even", "zipf"):
            even = [g.rows_per_expert] * g.num_experts
            sizes = zipf_splits(g.num_experts, g.rows_per_expert) if routing == "zipf" else even
            x, w, dy, off = operands(g.num_experts, sizes, g.k, g.n)
            for direction in directions:
                fns = columns(direction, x, w, dy, off, sizes, configs)
                auto = entry(direction, x, w, dy, off, sizes)
                torch.cuda.synchronize()
                tuner = autotune.tuner()
                table = tuner.table_for(torch.cuda.current_device())
                keys_before = set(table.ranking)
                charged, t0, tuner.last_miss_ms = tuner.budget.spent_ms, time.perf_counter(), None
                auto()  # the first call measures the bucket (outside the timed rounds)
                torch.cuda.synchronize()
                first_ms = (time.perf_counter() - t0) * 1e3
                charged_miss = tuner.budget.spent_ms - charged
                settle_calls = settle(auto, table, args.settle_burst or args.iters)
                fns["auto"], fns["static"] = auto, _static(auto)
                t = timing.interleaved_ms(fns, iters=args.iters, warmup=args.warmup, rounds=args.rounds)
                cands = {k: v for k, v in t.items() if k not in ("auto", "static")}
                best = min(cands, key=cands.get)
                pick = kernels.describe_choice(direction, dy if direction == "dgrad" else x, w, group_sizes=sizes)
                row = {"shape": g.name, "direction": direction, "routing": routing, "E": g.num_experts, "K": g.k,
                       "N": g.n, "rows_per_expert": g.rows_per_expert, "sizes": sizes, "ms": t, "best": best,
                       "auto_pick": pick, "first_call_ms": first_ms, "tune_wall_ms": tuner.last_miss_ms or 0.0,
                       "settle_calls": settle_calls, "settle_ms": tuner.budget.spent_ms - charged - charged_miss,
                       "tuned_ms": {autotune.key_text(k): table.ms.get(k) for k in set(table.ranking) - keys_before},
                       "auto_over_best": t["auto"] / t[best], "auto_over_torch": t["auto"] / t["torch"],
                       "static_over_torch": t["static"] / t["torch"]}
                if args.confirm_rounds and _flagged(row):
                    row["confirm"] = confirm(fns, t, best, _column(pick), args)
                rows.append(row)
                c = row.get("confirm")
                print(f"{g.name:<28}{direction:<6}{routing:<7}{t['auto']:9.4f}{t['static']:9.4f}{t[best]:9.4f} "
                      f"{best:<8}{t['torch']:9.4f}{row['auto_over_best']:10.3f}{row['auto_over_torch']:11.3f}  {pick}"
                      + (f"  | again: auto/best {c['auto_over_best']:.3f} ({c['best']}), auto/torch "
                         f"{c['auto_over_torch']:.3f}" if c else ""), flush=True)
                _write_sweep(args, settings, rows, complete=False)  # a sweep cut short keeps what it measured
            del x, w, dy
            torch.cuda.empty_cache()
    _write_sweep(args, settings, rows, complete=True)
    print("\n" + "\n".join(summary_lines(rows)))
    return rows


def _write_sweep(args, settings, rows, *, complete: bool) -> None:
    timing.write_json(args.json, {"sweep": rows,
                                  "geomean_auto_over_torch": timing.geomean(r["auto_over_torch"] for r in rows),
                                  "geomean_static_over_torch": timing.geomean(r["static_over_torch"] for r in rows)},
                      dtype="bfloat16", tokens_per_rank=args.tokens, bucket_ms=settings.bucket_ms, iters=args.iters,
                      rounds=args.rounds, warmup=args.warmup, complete=complete, confirm_rounds=args.confirm_rounds,
                      benchmark="grouped_gemm --sweep")


def _quantile(values, q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary_lines(rows) -> List[str]:
    """The sweep's closing lines: first-call wall time, the per-row goals before and after re-timing, the
    geomean, and auto against its own kernel's column (what one row's ratio can tell)."""
    firsts = [r["first_call_ms"] for r in rows]
    walls = [r["tune_wall_ms"] + r.get("settle_ms", 0.0) for r in rows]
    final = [r.get("confirm", r) for r in rows]
    to_torch = [r["auto_over_torch"] for r in rows]
    same = [r["ms"]["auto"] / r["ms"][_column(r["auto_pick"])] for r in rows if _column(r["auto_pick"]) in r["ms"]]
    settled = [r for r in rows if r.get("settle_calls")]
    lines = [f"first call of a bucket (wall ms): median {_quantile(firsts, 0.5):.1f}, p90 "
             f"{_quantile(firsts, 0.9):.1f}, max {max(firsts):.1f}",
             f"measuring a bucket (miss to choice, file write included, + live settling's charge), ms: median "
             f"{_quantile(walls, 0.5):.1f}, p90 {_quantile(walls, 0.9):.1f}, max {max(walls):.1f}; "
             f"{sum(w > 50 for w in walls)} of {len(walls)} rows past 50 ms"]
    if settled:
        calls = [r["settle_calls"] for r in settled]
        lines.append(f"settled on live calls: {len(settled)} rows, calls median {_quantile(calls, 0.5)}, max {max(calls)}")
    for label, rs in (("first pass", rows), ("after re-timing", final)):
        lines.append(f"{label}: auto >= {GOAL}x the best in {sum(r['auto_over_best'] <= 1 / GOAL for r in rs)} of "
                     f"{len(rs)} rows (worst {1 / max(r['auto_over_best'] for r in rs):.2f}x), >= {GOAL}x torch in "
                     f"{sum(r['auto_over_torch'] <= 1 / GOAL for r in rs)} (worst "
                     f"{1 / max(r['auto_over_torch'] for r in rs):.2f}x)")
    lines += [f"geomean speed of auto over torch: {1 / timing.geomean(to_torch):.3f}x (static: "
              f"{1 / timing.geomean([r['static_over_torch'] for r in rows]):.3f}x) over {len(rows)} GEMMs",
              f"resolution: auto's ms over its own kernel's column, p5 / median / p95 {_quantile(same, 0.05):.3f} / "
              f"{_quantile(same, 0.5):.3f} / {_quantile(same, 0.95):.3f} over {len(same)} rows"]
    return lines


# ------------------------------------------------------------------------------------------ entry
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--skip-backward", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated shape names, 'layer' for the MoE-layer shapes; "
                                                 "with --ragged LAYER_ROWS names; with --sweep model names")
    ap.add_argument("--candidates", nargs="?", const="all", default=None,
                    help="also time cutlass_kernels.CANDIDATES tiles: all, or comma-separated ids (e.g. 11,12)")
    ap.add_argument("--ragged", action="store_true", help="the MoE-layer rows with router-like group sizes")
    ap.add_argument("--seed", type=int, default=100, help="--ragged: seed of the group sizes (row i uses seed + i)")
    ap.add_argument("--sweep", action="store_true", help="public MoE shapes: the measured choice vs every candidate")
    ap.add_argument("--tokens", type=int, default=4096, help="--sweep: tokens per rank")
    ap.add_argument("--bucket-ms", type=float, default=None, help="--sweep: timed ms per bucket for auto's measurement")
    ap.add_argument("--tune-dir", default=None, help="--sweep: tuning-file directory (default: a fresh temp dir)")
    ap.add_argument("--write-shapes", default=None,
                    help="--sweep: write the shapes as JSON for `te-dist tune` and exit")
    ap.add_argument("--directions", default="fwd,dgrad,wgrad", help="--sweep: comma-separated directions")
    ap.add_argument("--settle-burst", type=int, default=None, help="--sweep: live calls per preconditioning "
                                                                  "while a bucket settles (default: --iters)")
    ap.add_argument("--no-settle", action="store_true", help="--sweep: the first call's ranking stands")
    ap.add_argument("--confirm-rounds", type=int, default=None, help="--sweep: rounds re-timing a row under 0.97x "
                                                                    "best or torch (default 3x --rounds; 0: off)")
    ap.add_argument("--summary", default=None, metavar="FILE", help="print a saved --sweep --json FILE's summary")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.summary:
        with open(args.summary) as f:
            data = json.load(f)
        print(f"{args.summary}: {data['meta']}\n" + "\n".join(summary_lines(data["sweep"])))
    elif args.sweep:
        sweep(args)
    else:
        tables(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
