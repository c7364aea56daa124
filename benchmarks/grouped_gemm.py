"""bf16 grouped GEMMs on one GPU: our CUTLASS tiles against torch._grouped_mm and cuBLAS per expert.

    python benchmarks/grouped_gemm.py [--rounds 5] [--json PATH] [--skip-backward]   # the model shapes
    python benchmarks/grouped_gemm.py --only layer       # the MoE-layer shapes of benchmarks/moe_layer.py
    python benchmarks/grouped_gemm.py --ragged [--seed 300]   # those rows with router-like group sizes
    python benchmarks/grouped_gemm.py --sweep [--seed 100] [--shapes 24] [--json PATH]   # drawn shapes: auto vs torch
    python benchmarks/grouped_gemm.py --sweep --smoke | --dry-run    # 3 small shapes, checked | the shapes, no GPU
    python benchmarks/grouped_gemm.py --sweep --write-shapes FILE   # the sweep's shapes, for `te-dist tune`
    python benchmarks/grouped_gemm.py --summary PATH                 # a saved sweep's closing lines
    python benchmarks/grouped_gemm.py --host-cpu [--rounds 5]        # no GPU: our host time per call over raw torch
    python benchmarks/grouped_gemm.py --host-gpu [--rounds 5]        # the same calls on CUDA tensors

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

``--sweep``: te_dist's grouped GEMM against torch._grouped_mm on shapes drawn from ``--seed``
(``draw_shapes``): experts E log-uniform in 8..256, K and N multiples of 16 in 512..8192, mean tokens per
expert log-uniform in 1..8192, group sizes Zipf-skewed with an exponent in 0..1.5 and 0-25% of the experts
empty; fewer experts, then fewer tokens, where the operands would pass ``--max-weight-gib`` or
``--max-tokens``; fwd, dgrad and wgrad of each. Columns, ms per call in one process on the same tensors:
``raw`` (torch._grouped_mm called directly), ``torch`` (te_dist.kernels with backend="torch": our wrapper
around torch's kernel), ``auto`` (te_dist.kernels deciding, the group sizes on the host as the MoE layer
passes them; its first call of a bucket, which measures where measuring is on, is made before the timing); the
speed ratios raw/torch and raw/auto, each the median over the rounds of that round's ratio (a round times the
columns back to back, so drift between rounds cancels; ``ratio`` in the JSON); raw/raw, raw's call timed again
as a fourth column (the row's noise floor: the same kernel on the same tensors); the host µs to queue one call
of each. Closing lines: the geomeans, the worst rows and the rows under the goals (torch path 0.99, auto 0.95
per row), the noise floor's range, and the rows whose torch path runs raw's GPU kernels and nothing more
(torch.profiler: no hidden copy). The tuning file lives in ``--tune-dir`` (default: a new temp dir, a fresh
process's table); a second run with the same ``--tune-dir`` gives the warm-table numbers. ``--smoke`` runs
three small shapes once and checks every column against torch; ``--dry-run`` prints the drawn shapes only (no
GPU); ``TE_DIST_TUNE=0`` times the static rule alone.

``--host-cpu``: the host time our wrapper adds to a call, on any machine (``host_time``). torch runs
``torch._grouped_mm`` on CPU too, so on tiny bf16 operands ``raw`` (torch's call) and ``torch``
(``grouped_mm_forward(..., backend="torch", check_offsets=False)``: validation, decision, torch's
call) differ by our host work; ``dgrad raw``/``dgrad torch`` and ``wgrad raw``/``wgrad torch`` are the
same pair for the backward GEMMs (raw: the operands as torch's backend hands them to torch), and each
direction's ``torch over raw`` is printed and written to ``--json``; ``decide`` and ``decide sizes``
time the decision of the same call on a faked SM 9.0 GPU (the capability hook; measuring on, the
bucket already measured, so the remembered function: ``entry._runner``, its operand a stand-in whose
attributes read faster than a tensor's), without and with host sizes. Median and best µs per call
over ``--rounds`` x 20 interleaved repeats.

``--host-gpu``: the same pairs on CUDA tensors of the same shapes, with the offsets left unread (a GPU caller's
default): every call queues torch's kernels, which run in a few µs, faster than the host queues them, so the time
per call is the host's, launches included, and the pairs differ by our host work (no ``decide`` columns: the
real device decides). Unlike the sweep's ``busy_host_us`` (20 calls per column per shape), 2000 calls per repeat.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
from types import SimpleNamespace
from typing import List, NamedTuple, Optional

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
    from te_dist.gemm import cutlass_backend, loop_backend, torch_backend

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
    from te_dist.gemm import cutlass_backend

    if direction == "fwd":
        return lambda: cutlass_backend.forward(x, w, off)
    if direction == "dgrad":
        return lambda: cutlass_backend.dgrad(dy, w, off)
    return lambda: cutlass_backend.wgrad(x, dy, off, w.shape[0])


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
    from te_dist.gemm import cutlass_backend, epilogue, torch_backend

    ck = cutlass_backend.kernels_module()
    tiles = sorted(ck.CONFIGS)
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


def host_time(args, dev: str = "cpu") -> dict:
    """--host-cpu (module doc): {column: (median, best) µs per call}, printed with the differences; ``dev`` "cuda":
    --host-gpu, the same calls on CUDA tensors, offsets left unread as a GPU caller leaves them (the tiny GEMMs run
    faster than the host queues them, so the per-call wall time is the host's)."""
    from te_dist import kernels, support
    from te_dist.gemm import entry, measure

    torch.set_num_threads(1)  # torch's share stays one core's, as the wrapper's is
    sizes = (2, 0, 3, 3)
    E, K, N = len(sizes), 16, 16
    x, w, dy, off = operands(E, list(sizes), K, N, dev=dev)
    # x as the decision sees a CUDA row operand (its attributes read faster than a tensor's)
    row = SimpleNamespace(device=torch.device("cuda", 0), dtype=x.dtype, shape=x.shape, is_cuda=True, is_cpu=False)
    stmts = {"raw": "torch._grouped_mm(x, w, offs=off)",
             "torch": "kernels.grouped_mm_forward(x, w, off, backend='torch', check_offsets=False)",
             "dgrad raw": "torch._grouped_mm(dy, w.mT, offs=off)",
             "dgrad torch": "kernels.grouped_mm_dgrad(dy, w, off, backend='torch', check_offsets=False)",
             "wgrad raw": "torch._grouped_mm(dy.mT, x, offs=off).mT",
             "wgrad torch": "kernels.grouped_mm_wgrad(x, dy, off, num_groups=E, backend='torch', check_offsets=False)",
             "decide": "entry._runner('fwd', args, row, row.device, x.dtype, w.shape, w.stride(), False, None)",
             "decide sizes": "entry._runner('fwd', args_sizes, row, row.device, x.dtype, w.shape, w.stride(), False, None)"}
    names = dict(torch=torch, kernels=kernels, entry=entry, row=row, x=x, w=w, dy=dy, off=off, sizes=sizes, E=E,
                 args=(x, w, off, None, None, x.dtype, None), args_sizes=(x, w, off, None, None, x.dtype, sizes))
    measure.reset(measure.Tuner(measure.TunerSettings(persist=False), identity=lambda index: ("cpu proxy", 132),
                                timer=lambda fn, calls: 1.0))  # a miss "times" every candidate alike
    if dev == "cuda":  # the real device decides; the decision's stand-in row is the CPU proxy's
        stmts = {k: v.replace(", check_offsets=False", "") for k, v in stmts.items()
                 if not k.startswith("decide")}
    with support.set_capability_lookup(lambda d: (9, 0) if d.type == "cuda" else None):
        for stmt in stmts.values():
            eval(stmt, names)  # the first call of a bucket looks it up (measures) once
        runs = {k: [] for k in stmts}
        for _ in range(args.rounds):
            both = timing.timeit_us(list(stmts.values()), names, 2000, 20, lambda v: (timing.median(v), min(v)))
            for key, pair in zip(stmts, both):
                runs[key].append(pair)
    measure.reset()
    out = {k: (timing.median(m for m, _ in v), min(b for _, b in v)) for k, v in runs.items()}
    where = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
    print(f"# host µs per call on {where} ({torch.__version__}, one thread): E={E} K={K} N={N} T={sum(sizes)} bf16\n"
          f"{'column':<20}{'median':>8}{'best':>8}")
    for key, (median, best) in out.items():
        print(f"{key:<20}{median:8.2f}{best:8.2f}")
    over = {}
    for direction, prefix in (("fwd", ""), ("dgrad", "dgrad "), ("wgrad", "wgrad ")):
        ours, raw = out[prefix + "torch"], out[prefix + "raw"]
        over[direction] = (ours[0] - raw[0], ours[1] - raw[1])
        print(f"{direction + ' torch over raw':<20}{over[direction][0]:8.2f}{over[direction][1]:8.2f}")
    timing.write_json(args.json, {"host_us": {k: {"median": m, "best": b} for k, (m, b) in out.items()},
                                  "torch_over_raw_us": {d: {"median": m, "best": b} for d, (m, b) in over.items()}},
                      dtype="bfloat16", benchmark=f"grouped_gemm --host-{'gpu' if dev == 'cuda' else 'cpu'}",
                      rounds=args.rounds)
    return out


# ------------------------------------------------------------------------------------------ --sweep
GOALS = {"torch": 0.99, "auto": 0.95}  # per-row speed ratio against raw torch._grouped_mm
GEOMEAN_GOAL = 0.98  # auto, fresh process


class Shape(NamedTuple):
    name: str
    num_experts: int
    k: int
    n: int
    sizes: tuple  # rows of each expert


def skewed_sizes(rng: random.Random, num_experts: int, mean_rows: int, skew: float, empty_share: float) -> tuple:
    """Rows per expert summing to about ``num_experts * mean_rows``: expert shares 1/rank^skew in a
    random order, ``empty_share`` of the experts (rounded down) left empty."""
    num_empty = int(empty_share * num_experts)
    busy = num_experts - num_empty
    weights = [1.0 / (r + 1) ** skew for r in range(busy)]
    total = num_experts * mean_rows
    sizes = [int(total * w / sum(weights)) for w in weights] + [0] * num_empty
    sizes[0] += max(0, total - sum(sizes)) if busy else 0
    rng.shuffle(sizes)
    return tuple(sizes)


def draw_shapes(seed: int, count: int, *, max_tokens: int = 65536, max_weight_gib: float = 2.0) -> List[Shape]:
    """``count`` shapes from ``seed`` (module doc); the same seed gives the same shapes."""
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        e = int(round(math.exp(rng.uniform(math.log(8), math.log(256)))))
        k, n = 16 * rng.randint(32, 512), 16 * rng.randint(32, 512)
        while e > 1 and e * k * n * 2 > max_weight_gib * 2 ** 30:
            e //= 2
        mean_rows = int(round(math.exp(rng.uniform(0.0, math.log(8192)))))
        mean_rows = max(1, min(mean_rows, max_tokens // e))
        skew, empty = rng.uniform(0.0, 1.5), rng.choice([0.0, 0.0, rng.uniform(0.0, 0.25)])
        sizes = skewed_sizes(rng, e, mean_rows, skew, empty)
        shapes.append(Shape(f"s{i}_E{e}_K{k}_N{n}_m{mean_rows}", e, k, n, sizes))
    return shapes


def smoke_shapes() -> List[Shape]:
    rng = random.Random(0)
    return [Shape("smoke_even", 8, 512, 1024, (64,) * 8), Shape("smoke_zipf", 16, 1024, 512, skewed_sizes(rng, 16, 96, 1.2, 0.125)),
            Shape("smoke_decode", 32, 2048, 768, skewed_sizes(rng, 32, 2, 0.5, 0.25))]


def table_line(row: dict) -> str:
    ms, host = row["ms"], row.get("host_us", {})
    return (f"{row['shape']:<30}{row['direction']:<6}{sum(row['sizes']):>8}{ms['raw']:10.4f}{ms['torch']:10.4f}"
            f"{ms['auto']:10.4f}{_ratio(row, 'torch'):9.3f}{_ratio(row, 'auto'):9.3f}"
            f"{_ratio(row, 'raw again') if 'raw again' in ms else float('nan'):9.3f}"
            f"{host.get('raw', float('nan')):8.1f}{host.get('torch', float('nan')):8.1f}"
            f"{host.get('auto', float('nan')):8.1f}  {row.get('pick', '')}")


HEADER = (f"{'shape':<30}{'dir':<6}{'rows':>8}{'raw ms':>10}{'torch ms':>10}{'auto ms':>10}{'raw/tor':>9}"
          f"{'raw/auto':>9}{'raw/raw':>9}{'us raw':>8}{'us tor':>8}{'us auto':>8}  auto pick")


def summary_lines(rows: List[dict], worst: int = 3) -> List[str]:
    """Geo-means of the speed ratios against raw torch, the worst rows, and the rows under each goal."""
    out = []
    for column in ("torch", "auto"):
        ratios = sorted(((_ratio(r, column), f"{r['shape']} {r['direction']}") for r in rows))
        under = sum(v < GOALS[column] for v, _ in ratios)
        out.append(f"{column}: geomean raw/{column} {timing.geomean([v for v, _ in ratios]):.3f} over {len(ratios)} rows; "
                   f"{under} under {GOALS[column]}; worst " + ", ".join(f"{v:.3f} ({name})" for v, name in ratios[:worst]))
    again = sorted(_ratio(r, "raw again") for r in rows if "raw again" in r["ms"])
    if again:
        out.append(f"noise floor, the same raw call timed twice: {min(again):.3f}..{max(again):.3f} over {len(again)} rows")
    listed = [r for r in rows if r.get("kernels", {}).get("raw")]
    if listed:
        same = sum(r["kernels"]["torch"] == r["kernels"]["raw"] for r in listed)
        out.append(f"torch path runs raw's GPU kernels and nothing more (torch.profiler): {same} of {len(listed)} rows")
    hosts = [r["host_us"]["torch"] - r["host_us"]["raw"] for r in rows if "host_us" in r]
    if hosts:
        out.append(f"host time over raw, torch path: median {sorted(hosts)[len(hosts) // 2]:.1f} us, max {max(hosts):.1f} us")
    return out


def _write_shapes(shapes, path) -> None:
    rows = [{"direction": "all", "E": s.num_experts, "K": s.k, "N": s.n,
             "rows_per_expert": max(1, sum(s.sizes) // s.num_experts), "ragged": len(set(s.sizes)) > 1, "name": s.name}
            for s in shapes]
    with open(path, "w") as f:
        json.dump({"shapes": rows}, f, indent=1)
    print(f"wrote {len(rows)} shapes ({len(rows) * 3} GEMMs) to {path}")


def _calls(direction, x, w, dy, off, sizes) -> dict:
    """{column: zero-argument call} of one GEMM; every column computes the same values."""
    from te_dist import kernels

    E = w.shape[0]
    if direction == "fwd":
        calls = {"raw": lambda: torch._grouped_mm(x, w, offs=off),
                 "torch": lambda: kernels.grouped_mm_forward(x, w, off, backend="torch"),
                 "auto": lambda: kernels.grouped_mm_forward(x, w, off, group_sizes=sizes)}
    elif direction == "dgrad":
        calls = {"raw": lambda: torch._grouped_mm(dy, w.mT, offs=off),
                 "torch": lambda: kernels.grouped_mm_dgrad(dy, w, off, backend="torch"),
                 "auto": lambda: kernels.grouped_mm_dgrad(dy, w, off, group_sizes=sizes)}
    else:
        calls = {"raw": lambda: torch._grouped_mm(dy.mT, x, offs=off).mT,
                 "torch": lambda: kernels.grouped_mm_wgrad(x, dy, off, num_groups=E, backend="torch"),
                 "auto": lambda: kernels.grouped_mm_wgrad(x, dy, off, num_groups=E, group_sizes=sizes)}
    calls["raw again"] = calls["raw"]  # the same call timed as a fourth column: the row's noise floor
    return calls


def cuda_kernels(fn) -> Optional[List[str]]:
    """Names of the GPU kernels and copies one call of ``fn`` runs (torch.profiler), sorted; None where the
    profiler gives no GPU activity. Our torch path running raw's list runs torch's kernel and nothing more."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except RuntimeError:  # a build without the GPU profiler (kineto): the row says nothing of kernels
        return None
    names = sorted(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return names or None


def _timed(fns: dict, **timed) -> dict:
    """{"ms": each column's median ms, "ratio": raw over each other column, paired by round}."""
    samples = timing.interleaved_samples(fns, **timed)
    return {"ms": {name: statistics.median(v) for name, v in samples.items()},
            "ratio": {name: timing.paired_ratio(samples["raw"], v) for name, v in samples.items() if name != "raw"}}


def _ratio(row: dict, column: str) -> float:
    """raw over ``column`` of a row: paired by round where the row has it, else the ratio of the medians."""
    return row["ratio"][column] if "ratio" in row else row["ms"]["raw"] / row["ms"][column]


def sweep(args) -> list:
    shapes = smoke_shapes() if args.smoke else draw_shapes(args.seed, args.shapes, max_tokens=args.max_tokens,
                                                            max_weight_gib=args.max_weight_gib)
    if args.write_shapes:
        _write_shapes(shapes, args.write_shapes)
        return []
    if args.dry_run:
        for s in shapes:
            print(f"{s.name:<30} E={s.num_experts:<4} K={s.k:<5} N={s.n:<5} rows={sum(s.sizes):<7} "
                  f"empty={s.sizes.count(0):<3} max/mean={max(s.sizes) * s.num_experts / max(1, sum(s.sizes)):.1f}")
        return []
    from te_dist import kernels
    from te_dist.gemm import measure

    dev = torch.device("cuda")
    tune_dir = args.tune_dir or tempfile.mkdtemp(prefix="te_dist_sweep_tune_")
    measure.configure(directory=tune_dir)
    rounds, iters = (1, 3) if args.smoke else (args.rounds, args.iters)
    # cuBLAS's own start is paid by a training process's dense layers before its first expert GEMM
    torch.mm(torch.ones(64, 64, device=dev, dtype=torch.bfloat16), torch.ones(64, 64, device=dev, dtype=torch.bfloat16))
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; {len(shapes)} shapes x 3 directions, seed "
          f"{args.seed}; measuring {'on' if measure.tuner().enabled else 'off'}, tuning file in {tune_dir}\n{HEADER}")
    rows = []
    for s in shapes:
        T, E = sum(s.sizes), s.num_experts
        x = torch.randn(T, s.k, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(E, s.n, s.k, device=dev, dtype=torch.bfloat16) / s.k ** 0.5).transpose(1, 2)
        dy = torch.randn(T, s.n, device=dev, dtype=torch.bfloat16)
        off = torch.tensor(s.sizes, device=dev).cumsum(0).to(torch.int32)
        for direction in ("fwd", "dgrad", "wgrad"):
            fns = _calls(direction, x, w, dy, off, s.sizes)
            first = fns["auto"]()  # the bucket's first call: it measures where measuring is on
            if args.smoke:
                ref = fns["raw"]().float()
                for name in ("torch", "auto"):
                    got = fns[name]().float()
                    err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                    assert err < 2e-2, f"{s.name} {direction} {name}: relative error {err:.2e} against torch"
            del first
            row = {"shape": s.name, "direction": direction, "E": E, "K": s.k, "N": s.n, "sizes": list(s.sizes),
                   **_timed(fns, iters=iters, warmup=args.warmup, rounds=rounds),
                   "host_us": {name: timing.busy_host_us(fn) for name, fn in fns.items() if name != "raw again"},
                   "kernels": {name: cuda_kernels(fns[name]) for name in ("raw", "torch")},
                   "pick": kernels.describe_choice(direction, dy if direction == "dgrad" else x, w, group_sizes=s.sizes)}
            rows.append(row)
            print(table_line(row), flush=True)
        del x, w, dy
        torch.cuda.empty_cache()
    print("\n" + "\n".join(summary_lines(rows)))
    timing.write_json(args.json, {"sweep": rows}, dtype="bfloat16", benchmark="grouped_gemm --sweep", seed=args.seed,
                      shapes=len(shapes), smoke=args.smoke, iters=iters, rounds=rounds,
                      measuring=measure.tuner().enabled, tune_dir=tune_dir)
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--skip-backward", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated shape names, 'layer' for the MoE-layer shapes; "
                                                 "with --ragged LAYER_ROWS names")
    ap.add_argument("--ragged", action="store_true", help="the MoE-layer rows with router-like group sizes")
    ap.add_argument("--seed", type=int, default=100, help="--ragged: seed of the group sizes (row i uses seed + i); "
                                                          "--sweep: seed of the shapes")
    ap.add_argument("--sweep", action="store_true", help="shapes drawn from --seed: raw torch vs our torch path vs auto")
    ap.add_argument("--shapes", type=int, default=24, help="--sweep: how many shapes (x 3 directions)")
    ap.add_argument("--max-tokens", type=int, default=65536, help="--sweep: rows of one GEMM at most")
    ap.add_argument("--max-weight-gib", type=float, default=2.0, help="--sweep: one weight's GiB at most")
    ap.add_argument("--smoke", action="store_true", help="--sweep: 3 small shapes, 1 round, results checked")
    ap.add_argument("--dry-run", action="store_true", help="--sweep: print the drawn shapes and exit (no GPU)")
    ap.add_argument("--tune-dir", default=None, help="--sweep: tuning-file directory (default: a fresh temp dir)")
    ap.add_argument("--write-shapes", default=None,
                    help="--sweep: write the shapes as JSON for `te-dist tune` and exit")
    ap.add_argument("--summary", default=None, metavar="FILE", help="print a saved --sweep --json FILE's summary")
    ap.add_argument("--host-cpu", action="store_true", help="no GPU: our host time per call over raw torch, on CPU")
    ap.add_argument("--host-gpu", action="store_true", help="--host-cpu's calls on CUDA tensors (2000 per repeat)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.summary:
        with open(args.summary) as f:
            data = json.load(f)
        print(f"{args.summary}: {data['meta']}\n" + "\n".join(summary_lines(data["sweep"])))
    elif args.host_cpu or args.host_gpu:
        host_time(args, "cuda" if args.host_gpu else "cpu")
    elif args.sweep:
        sweep(args)
    else:
        tables(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
