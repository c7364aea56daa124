"""Grouped GEMM throughput on one GPU: our CUTLASS kernels vs torch._grouped_mm vs a per-expert loop.

    python benchmarks/grouped_gemm.py [--iters 10] [--warmup 3] [--json out.json] [--skip-backward]
    python benchmarks/grouped_gemm.py --only layer      # the MoE-layer shapes of benchmarks/moe_layer.py
    python benchmarks/grouped_gemm.py --ragged          # the MoE-layer rows with router-like ragged splits
    python benchmarks/grouped_gemm.py --ragged --candidates --seed 200   # also the candidate tiles, other sizes
    python benchmarks/grouped_gemm.py --only small_m_E64 --candidates 11,12   # two of the candidate tiles
    python benchmarks/grouped_gemm.py --sweep [--json out.json]   # public MoE shapes: the measured choice
                                                                  # vs every candidate (grouped_gemm_sweep.py)

Prints TFLOP/s per backend (CUTLASS per config and with the heuristic's choice), the backend the
selector picks ("auto") and its ratio to the best of the three, the CUTLASS/torch ratio and its
geometric mean over the six ANCHORS.md shapes, dgrad/wgrad rows, and the fused bias+scale epilogue
against GEMM followed by separate bias and scale kernels. Timings: CUDA events, mean of --iters
calls after --warmup calls; the variants of one shape are timed in interleaved rounds (each round
times every variant once, in a rotated order) and each reports its median over --rounds rounds, so
clock and thermal drift during a shape affect all variants alike; ratios are within this run.
"auto/best" divides the selector's choice by the best column of any kind (every config, torch,
loop), the strict reading of the issue's "best of the three".

Every timed sample starts behind the same preconditioning work, six dense 8192^3 bf16 GEMMs
(~8.5 ms): the host queues the start event and all --iters calls while the GPU runs them, so the
numbers are GPU throughput (as in a training step, where the host runs ahead), and every variant
starts from the same power state. Why: without it, (1) the GPU waited for the first call of each
sample to be queued, which charged 1/--iters of one call's host time to every call (3-4% for the
selector on the decode shapes of the H200 host), and (2) a variant timed right after a light one
(a slow tile, the per-expert loop) ran on the power headroom that one left: the same kernel measured
up to 12% apart in two columns of one run. The selector's host cost is its own table:
microseconds of host time per call, queued while the GPU is busy.

``--ragged`` times the GEMMs of benchmarks/moe_layer.py's rows with the group sizes a router
gives (seeded: expert shares softmax(0.2 * randn), rows drawn multinomially, this rank's experts
kept), not equal ones: a grouped kernel pads every group to whole tiles, so uniform splits flatter
it. There, as in the MoE layer, "auto" gets the group sizes on the host (``group_sizes=``) and may
pick cuBLAS per expert; "loop" is cuBLAS per expert with the sizes on the host (no offsets read)
in every table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from te_dist import kernels  # noqa: E402
from te_dist.backends import cutlass_backend, epilogue, loop_backend, torch_backend  # noqa: E402

import grouped_gemm_sweep  # noqa: E402  (beside this file: the script's directory is on sys.path)

cutlass_kernels = cutlass_backend.kernels_module()
CONFIGS, choose_config = cutlass_kernels.CONFIGS, cutlass_kernels.choose_config

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
# The GEMMs of benchmarks/moe_layer.py's rows (uniform routing): DeepSeek-like at EP=1 with 2048 tokens
# and at EP=2 with 1024 tokens per rank (256 rows per expert), Mixtral-like at EP=2 with 2048 (~1024).
LAYER = [  # name, E, rows per expert, K, N
    ("ds_layer_fc1_256", 64, 256, 7168, 4096),
    ("ds_layer_fc2_256", 64, 256, 2048, 7168),
    ("mx_layer_fc1_1024", 4, 1024, 4096, 28672),
    ("mx_layer_fc2_1024", 4, 1024, 14336, 4096),
]
# --ragged: benchmarks/moe_layer.py's rows (config, EP, tokens per rank) with router-like group sizes.
LAYER_ROWS = [  # name, experts, local experts, rows routed over all ranks, hidden, ffn
    ("mx_ep2_2048", 8, 4, 2 * 2048 * 2, 4096, 14336),
    ("mx_ep1_2048", 8, 8, 2048 * 2, 4096, 14336),
    ("mx_ep2_8192", 8, 4, 2 * 8192 * 2, 4096, 14336),
    ("mx_ep1_8192", 8, 8, 8192 * 2, 4096, 14336),
    ("ds_ep2_1024", 64, 32, 2 * 1024 * 8, 7168, 2048),
    ("ds_ep1_1024", 64, 64, 1024 * 8, 7168, 2048),
    ("ds_ep2_2048", 64, 32, 2 * 2048 * 8, 7168, 2048),
    ("ds_ep1_8192", 64, 64, 8192 * 8, 7168, 2048),
]


def router_like_splits(seed, experts, local, rows):
    """Rows of this rank's ``local`` experts when ``rows`` token copies are routed with skewed shares."""
    g = torch.Generator().manual_seed(seed)
    shares = torch.softmax(0.2 * torch.randn(experts, generator=g), 0)
    picks = torch.multinomial(shares, rows, replacement=True, generator=g)
    return picks.bincount(minlength=experts)[:local].tolist()


def ragged_cases(seed=100):
    """(name, E, splits, K, N) for fc1 and fc2 of every LAYER_ROWS row."""
    cases = []
    for i, (name, E, El, rows, H, F) in enumerate(LAYER_ROWS):
        splits = router_like_splits(seed + i, E, El, rows)
        cases += [(f"{name}_fc1", El, splits, H, 2 * F), (f"{name}_fc2", El, splits, F, H)]
    return cases


_HOST_SPIN_CYCLES = 40_000_000  # ~20 ms at the H200's clock: longer than queueing 20 calls on a slow host
_HEAT = []  # the preconditioning operands, made on first use


def _queued_start() -> torch.cuda.Event:
    """A start event queued behind the preconditioning GEMMs (see the module docstring)."""
    if not _HEAT:
        _HEAT.append(torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16))
    a = _HEAT[0]
    for _ in range(6):
        torch.mm(a, a)
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    return start


def bench(fn, warmup, iters, repeats=5):
    """Median over ``repeats`` of the mean per-call time (ms) of ``iters`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = _queued_start(), torch.cuda.Event(enable_timing=True)
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[len(times) // 2]


def bench_interleaved(fns, warmup, iters, rounds):
    """{name: median ms per call}: ``rounds`` rounds, each timing every fn once (rotated order)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    names = list(fns)
    samples = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            start, end = _queued_start(), torch.cuda.Event(enable_timing=True)
            for _ in range(iters):
                fns[n]()
            end.record()
            torch.cuda.synchronize()
            samples[n].append(start.elapsed_time(end) / iters)
    return {n: sorted(v)[len(v) // 2] for n, v in samples.items()}


def host_us(fn, calls=20, repeats=5) -> float:
    """Median host time (us) to queue one call, measured while the GPU is busy (nothing waits on it)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(_HOST_SPIN_CYCLES)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def make(E, splits, K, N, dev):
    T = sum(splits)
    x = torch.randn(T, K, device=dev).bfloat16()
    w = (torch.randn(E, N, K, device=dev) / K ** 0.5).bfloat16().transpose(1, 2)
    off = torch.tensor(splits, device=dev).cumsum(0).to(torch.int32)
    return x, w, off


def print_step_sums(results):
    """--ragged: the six GEMMs of one layer step (fc1 and fc2, forward, dgrad, wgrad) summed per column."""
    print("\n## six GEMMs of one MoE-layer step, ragged group sizes (ms; best = the fastest column of each GEMM)")
    cols = ("auto", "cutlass", "torch", "loop", "best")
    print(f"{'row':<14}" + "".join(f"{c:>9}" for c in cols) + f"{'best/auto':>10}{'cut/auto':>10}")
    rows = {}
    for entry in results["forward"] + results["backward"]:
        ms = entry["ms"]
        acc = rows.setdefault(entry["shape"].rsplit("_", 1)[0], dict.fromkeys(cols, 0.0))
        for c in cols[:-1]:
            acc[c] += ms[c]
        acc["best"] += min(v for k, v in ms.items() if k != "auto")
    for row, acc in rows.items():
        print(f"{row:<14}" + "".join(f"{acc[c]:9.3f}" for c in cols)
              + f"{acc['best'] / acc['auto']:10.3f}{acc['cutlass'] / acc['auto']:10.3f}")


def candidate_ids(spec):
    """The candidate tiles ``--candidates`` names: none, "all", or comma-separated ids."""
    if spec is None:
        return []
    if spec == "all":
        return sorted(cutlass_kernels.CANDIDATES)
    ids = [int(c) if c.strip().isdigit() else c for c in spec.split(",")]
    unknown = [c for c in ids if c not in cutlass_kernels.CANDIDATES]
    if unknown:
        raise SystemExit(f"--candidates expects ids of cutlass_kernels.CANDIDATES {sorted(cutlass_kernels.CANDIDATES)}, "
                         f"received {unknown}")
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-backward", action="store_true")
    ap.add_argument("--only", default=None,
                    help="comma-separated shape names, or 'layer' for the MoE-layer shapes (default: ANCHORS + "
                         "decode); with --ragged, LAYER_ROWS names")
    ap.add_argument("--candidates", nargs="?", const="all", default=None,
                    help="also time cutlass_kernels.CANDIDATES tiles in every table (built on first use): all, "
                         "or comma-separated ids (e.g. 11,12)")
    ap.add_argument("--ragged", action="store_true",
                    help="the MoE-layer rows with router-like group sizes (module docstring), not the default shapes")
    ap.add_argument("--seed", type=int, default=100, help="--ragged: seed of the group sizes (row i uses seed + i)")
    grouped_gemm_sweep.add_arguments(ap)
    args = ap.parse_args()
    if args.summary:
        return grouped_gemm_sweep.print_summary(args.summary)
    if args.sweep:
        return grouped_gemm_sweep.run_sweep(args, bench_interleaved, _queued_start)
    dev = torch.device("cuda")
    W, I = args.warmup, args.iters
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; per call: median over {args.rounds} interleaved rounds of the mean of {I} calls, after {W} warm-up")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    dense = bench(lambda: a @ a, 5, 10)  # also brings the clocks up before the first measured shape
    print(f"# dense bf16 8192^3 a @ a: {2 * 8192 ** 3 / dense / 1e9:.0f} TFLOP/s")
    results = {"meta": {"hardware": f"1 x {torch.cuda.get_device_name()}", "torch": torch.__version__,
                        "dtype": "bfloat16"},
               "forward": [], "backward": [], "epilogue": []}  # --json: benchmarks/plots.py reads it

    cases = [(n, E, [m] * E, K, N) for n, E, m, K, N in SHAPES]
    for n, E, T, K, N in DECODE:
        base, extra = divmod(T, E)
        cases.append((n, E, [base + (i < extra) for i in range(E)], K, N))
    if args.only:
        wanted = set(args.only.split(","))
        if "layer" in wanted:
            wanted |= {s[0] for s in LAYER}
        cases = [c for c in cases + [(n, E, [m] * E, K, N) for n, E, m, K, N in LAYER] if c[0] in wanted]
    if args.ragged:  # --only then names LAYER_ROWS rows (both GEMMs) or single GEMMs, e.g. ds_ep2_1024,mx_ep2_2048_fc1
        cases = [c for c in ragged_cases(args.seed)
                 if not args.only or {c[0], c[0].rsplit("_", 1)[0]} & set(args.only.split(","))]
    sizes_for_auto = (lambda splits: splits) if args.ragged else (lambda splits: None)

    configs = sorted(CONFIGS)
    tiles = configs + candidate_ids(args.candidates)  # every table times these
    tile_cols = "".join(f"{'c' + str(c):>8}" for c in tiles)
    hdr = f"{'shape':<16}{tile_cols}{'cut':>8}{'torch':>8}{'loop':>8}{'auto':>8} {'pick':<10}{'best':<6}{'auto/best':>10}{'cut/torch':>10}"
    print("\n## forward bf16 (TFLOP/s; cN = CUTLASS config N, cut = the tile table's config from the shape alone, auto = grouped_mm_forward)\n" + hdr)
    geo = []
    for name, E, splits, K, N in cases:
        x, w, off = make(E, splits, K, N, dev)
        flop = 2.0 * sum(splits) * K * N
        fns = {f"c{c}": (lambda c=c: cutlass_backend.forward(x, w, off, config=c)) for c in tiles}
        fns["cutlass"] = lambda: cutlass_backend.forward(x, w, off)
        fns["torch"] = lambda: torch_backend.forward(x, w, off)
        fns["loop"] = lambda: loop_backend.forward(x, w, off, group_sizes=splits)
        fns["auto"] = lambda: kernels.grouped_mm_forward(x, w, off, group_sizes=sizes_for_auto(splits))
        ref = torch_backend.forward(x, w, off).float()
        wrong = [c for c in tiles
                 if (cutlass_backend.forward(x, w, off, config=c).float() - ref).norm() > 1e-2 * ref.norm()]
        if wrong:  # a fast wrong kernel must not win a sweep
            print(f"# {name}: configs {wrong} disagree with torch._grouped_mm (relative error > 1e-2)")
        t = bench_interleaved(fns, W, I, args.rounds)
        pick = kernels.select_backend("fwd", x, w, group_sizes=sizes_for_auto(splits))
        if pick == "cutlass":
            pick += f"/c{choose_config('fwd', sum(splits), N, K, E, group_sizes=sizes_for_auto(splits))}"
        tf = {k: flop / v / 1e9 for k, v in t.items()}
        best_name = max(["cutlass", "torch", "loop"] + [f"c{c}" for c in tiles], key=lambda k: tf[k])
        best3 = max(tf[k] for k in tf if k != "auto")
        ratio = tf["cutlass"] / tf["torch"]
        if name in [s[0] for s in SHAPES]:
            geo.append(ratio)
        cols = "".join(f"{tf[f'c{c}']:8.1f}" for c in tiles)
        print(f"{name:<16}{cols}{tf['cutlass']:8.1f}{tf['torch']:8.1f}{tf['loop']:8.1f}{tf['auto']:8.1f} {pick:<10}"
              f"{best_name:<6}{tf['auto'] / best3:10.3f}{ratio:10.3f}")
        results["forward"].append({"shape": name, "tflops": tf, "ms": t, "pick": pick})
        torch.cuda.empty_cache()
    if len(geo) == len(SHAPES):
        gm = math.exp(sum(map(math.log, geo)) / len(geo))
        print(f"geomean cutlass(heuristic)/torch over the six ANCHORS shapes: {gm:.3f}")
        results["geomean_cutlass_over_torch"] = gm

    print("\n## host time to queue one forward call (us; cut = cutlass_backend.forward with the heuristic's config,"
          " auto = grouped_mm_forward: validation + selection + cut)")
    print(f"{'shape':<16}{'cut':>8}{'auto':>8}{'torch':>8}{'auto-cut':>9}")
    for name, E, splits, K, N in cases:
        x, w, off = make(E, splits, K, N, dev)
        h = {k: host_us(fn) for k, fn in (("cut", lambda: cutlass_backend.forward(x, w, off)),
                                          ("auto", lambda: kernels.grouped_mm_forward(
                                              x, w, off, group_sizes=sizes_for_auto(splits))),
                                          ("torch", lambda: torch_backend.forward(x, w, off)))}
        print(f"{name:<16}{h['cut']:8.1f}{h['auto']:8.1f}{h['torch']:8.1f}{h['auto'] - h['cut']:9.1f}")
        results.setdefault("host_us", []).append({"shape": name, **h})
        torch.cuda.empty_cache()

    if not args.skip_backward:
        for direction in ("dgrad", "wgrad"):
            print(f"\n## {direction} bf16 (TFLOP/s; auto = grouped_mm_{direction}, loop = cuBLAS per expert)\n"
                  f"{'shape':<16}{tile_cols}{'cut':>8}{'torch':>8}{'loop':>8}{'auto':>8} {'best':<8}{'auto/best':>10}")
            for name, E, splits, K, N in cases:
                x, w, off = make(E, splits, K, N, dev)
                dy = torch.randn(x.shape[0], N, device=dev).bfloat16()
                flop = 2.0 * x.shape[0] * K * N
                if direction == "dgrad":
                    fns = {f"c{c}": (lambda c=c: cutlass_backend.dgrad(dy, w, off, config=c)) for c in tiles}
                    fns["cutlass"] = lambda: cutlass_backend.dgrad(dy, w, off)
                    fns["torch"] = lambda: torch_backend.dgrad(dy, w, off)
                    fns["loop"] = lambda: loop_backend.dgrad(dy, w, off, group_sizes=splits)
                    fns["auto"] = lambda: kernels.grouped_mm_dgrad(dy, w, off, group_sizes=sizes_for_auto(splits))
                else:
                    fns = {f"c{c}": (lambda c=c: cutlass_backend.wgrad(x, dy, off, E, config=c)) for c in tiles}
                    fns["cutlass"] = lambda: cutlass_backend.wgrad(x, dy, off, E)
                    fns["torch"] = lambda: torch_backend.wgrad(x, dy, off, E)
                    fns["loop"] = lambda: loop_backend.wgrad(x, dy, off, E, group_sizes=splits)
                    fns["auto"] = lambda: kernels.grouped_mm_wgrad(x, dy, off, num_groups=E,
                                                                   group_sizes=sizes_for_auto(splits))
                t = bench_interleaved(fns, W, I, args.rounds)
                tf = {k: flop / v / 1e9 for k, v in t.items()}
                best_name = max((k for k in tf if k != "auto"), key=lambda k: tf[k])
                cols = "".join(f"{tf[f'c{c}']:8.1f}" for c in tiles)
                print(f"{name:<16}{cols}{tf['cutlass']:8.1f}{tf['torch']:8.1f}{tf['loop']:8.1f}{tf['auto']:8.1f} "
                      f"{best_name:<8}{tf['auto'] / tf[best_name]:10.3f}")
                results["backward"].append({"shape": name, "direction": direction, "tflops": tf, "ms": t})
                torch.cuda.empty_cache()

    if args.ragged and not args.skip_backward:
        print_step_sums(results)

    print("\n## fused bias + row-scale epilogue (ms; ratio = unfused / fused)")
    print(f"{'shape':<16}{'fused':>9}{'cut+sep':>9}{'torch+sep':>10}{'vs cut+sep':>11}{'vs torch+sep':>13}")
    timed_names = {c[0] for c in cases}
    for name, E, m, K, N in SHAPES:
        if name not in timed_names:
            continue
        x, w, off = make(E, [m] * E, K, N, dev)
        bias = torch.randn(E, N, device=dev)
        scale = torch.rand(x.shape[0], device=dev)
        fused = bench(lambda: cutlass_backend.forward(x, w, off, bias, scale), W, I)
        cut_sep = bench(lambda: epilogue.apply_epilogue(cutlass_backend.forward(x, w, off), off, bias, scale,
                                                        torch.bfloat16), W, I)
        tor_sep = bench(lambda: torch_backend.forward(x, w, off, bias, scale), W, I)
        print(f"{name:<16}{fused:9.3f}{cut_sep:9.3f}{tor_sep:10.3f}{cut_sep / fused:11.3f}{tor_sep / fused:13.3f}")
        results["epilogue"].append({"shape": name, "fused_ms": fused, "cutlass_sep_ms": cut_sep, "torch_sep_ms": tor_sep})
        torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
