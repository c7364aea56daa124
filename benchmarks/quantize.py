"""Quantization throughput against a device-to-device copy measured in the same run.

    python benchmarks/quantize.py casts                 # every recipe's cast of x (CUDA: 8192x8192 bf16, else tiny)
    python benchmarks/quantize.py casts --eager         # without torch.compile (what fusion buys)
    python benchmarks/quantize.py casts --device cpu --rows 256 --cols 512
    python benchmarks/quantize.py weights [--configs mixtral,deepseek,qwen3_235b,gptoss] [--recipes current,delayed,block]
                                          [--sweep]     # (GPU) the expert weights' FP8 cast per training step
    python benchmarks/quantize.py swiglu [--shapes 262144x1024,32768x14336]  # (GPU) the FP8 SwiGLU kernels' launches
    python benchmarks/quantize.py blocks [--shapes 266240x2048g,32768x32000]  # (GPU) the 1x128 CUDA cast's launches

``casts``: per case a "triton" row (the fused Triton casts, the default on CUDA) and a "compiled" (or
"eager") row: the cast functions. GB/s counts the bytes a quantize must move at least once (input read,
every output written, scales included); ``vs copy`` divides by the copy's GB/s (input read and written).
"time" is a queued loop, host included ("host" near it: host-bound); "GPU" replays the same calls from
one CUDA graph (kernels only) against a graph-replayed copy. Goal: GPU >= 0.50 of copy bandwidth for
per-tensor and block formats.

``weights``: ``GroupedLinear.quantized_weight()`` of fc1 [E, 2F, H] and fc2 [E, H, F], the whole path a
training forward runs after the optimizer wrote the weights (both GEMM layouts, scales), median of
--iters calls, against a copy of the same bf16 weights. ``floor GB`` = the bytes the recipe must move
(current scaling: an amax read, then one pass writing both layouts = 6 bytes per element; delayed: 4;
128x128 blocks: 4, plus scales); ``of bound`` = (floor GB / ms) / the copy's bandwidth, goal >= 0.8;
rows ``current+1pass`` / ``delayed+1pass`` run the one-pass CUDA cast (``settings.cuda_rowcol_cast``);
``vs 4 B`` = moving 4 bytes per element at copy bandwidth over ``ms``. ``--sweep`` also times the
candidate tiles of the 128x128 block cast (``tile=``), each checked against the default tile's bytes.

``swiglu``: the FP8 expert MLP's SwiGLU kernels on rows x F (``ops/basic/swiglu_triton.py``): the forward
writing the FP8 copy of h, the backward reading it, and the backward reading bf16 h; per kernel the
launch of today's rule against the former 4-warp launch, interleaved in one process, same outputs
checked; ``of copy`` = the bytes the kernel moves at least once over ms, against the copy's bandwidth.

``blocks``: Float8BlockScaling's 1x128 CUDA cast (``cuda_blocks.cast_blocks``, both copies, M-major column scales,
as the training step's activations and gradients take it) on rows x C, ``g``: the rows gathered from a source of
an eighth as many (the MoE experts' input at top-8), under every launch of ``cuda_blocks.BLOCK_LAUNCHES``,
interleaved in one process, each checked equal to launch 0; ``of copy`` as above (x read, both copies and their
scales written). Defaults: the DeepSeek-like job step's casts (expert input gathered, SwiGLU output, the LM head's
gradient, an attention input).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import timing

CASES = [  # (label, recipe name, role, columnwise copy too)
    ("delayed (E4M3, per-tensor)", "delayed_e4m3", "input", False),
    ("current (E4M3, per-tensor)", "current_e4m3", "input", False),
    ("current pow2 (E5M2 grad)", "current_pow2", "grad_output", False),
    ("block 1x128 (input)", "block", "input", False),
    ("block 128x128 (weight)", "block", "weight", False),
    ("block 1x128 row+col (input)", "block", "input", True),
    ("mxfp8 1x32", "mxfp8", "input", False),
    ("mxfp8 1x32 row+col", "mxfp8", "input", True),
    ("nvfp4 1x16 (input, rowwise)", "nvfp4", "input", False),
    ("nvfp4 16x16 (weight)", "nvfp4", "weight", False),
    ("nvfp4 1x16 SR (grad)", "nvfp4", "grad_output", False),
]


ONE_PASS_RECIPES = ("current", "delayed")  # casts settings.cuda_rowcol_cast switches (docs/quantization.md)


def _recipe(name):
    from te_dist import recipe as R

    return {"delayed_e4m3": lambda: R.DelayedScaling(fp8_format=R.Format.E4M3, amax_history_len=1024),
            "current_e4m3": lambda: R.Float8CurrentScaling(fp8_format=R.Format.E4M3),
            "current_pow2": lambda: R.Float8CurrentScaling(use_power_2_scales=True),
            "block": R.Float8BlockScaling, "mxfp8": R.MXFP8BlockScaling, "nvfp4": R.NVFP4BlockScaling}[name]()


def _output_bytes(q) -> int:
    from te_dist.quantization import Float8Tensor

    if isinstance(q, Float8Tensor):
        return q.data.numel() * q.data.element_size() + 4
    total = 0
    for copy in (q.rowwise, q.columnwise):
        if copy is not None:
            total += copy.data.numel() * copy.data.element_size()
            total += copy.scale_inv.numel() * copy.scale_inv.element_size()
            total += 4 if copy.global_scale_inv is not None else 0
    return total


def _queued(fn, device, warmup: int, iters: int) -> tuple:
    """(seconds per call, host seconds to queue one): medians over 5 rounds of ``iters`` calls queued back to
    back, as in training where the host runs ahead of the GPU."""
    if device.type != "cuda":
        us = timing.host_us(fn, iters, rounds=5, warmup=warmup)
        return us / 1e6, us / 1e6
    for _ in range(warmup):
        fn()
    rounds, host = [], []
    for _ in range(5):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host.append((time.perf_counter() - t0) / iters)
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(rounds), statistics.median(host)


def casts(args) -> list:
    from te_dist import recipe as R
    from te_dist import settings
    from te_dist.quantization import fused_casts_available, make_quantizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    rows_n, cols_n = args.rows or (8192 if cuda else 256), args.cols or (8192 if cuda else 512)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 3)
    iters = args.iters if args.iters is not None else (20 if cuda else 3)
    if args.eager and args.compile:
        raise SystemExit("--eager and --compile exclude each other")
    if args.fused and args.no_fused:
        raise SystemExit("--fused and --no-fused exclude each other")
    compiled = False if args.eager else (True if args.compile else None)
    torch.manual_seed(0)
    x = torch.randn(rows_n, cols_n, device=device, dtype=getattr(torch, args.dtype))
    in_bytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    copy_s, _ = _queued(lambda: dst.copy_(x), device, warmup, iters)
    copy_gbs = 2 * in_bytes / copy_s / 1e9
    copy_graph = timing.graph_ms(lambda: dst.copy_(x), iters) if cuda else None
    mode = "torch.compile" if args.compile or (cuda and not args.eager) else "eager"
    with_fused = (cuda or args.fused) and not args.no_fused and fused_casts_available()
    fused_setting = True if args.fused else None  # None: automatic (CUDA)
    fused_recipes = (R.DelayedScaling, R.Float8CurrentScaling, R.Float8BlockScaling, R.MXFP8BlockScaling,
                     R.NVFP4BlockScaling)
    reference = "compiled" if mode == "torch.compile" else "eager"
    print(f"device={timing.hardware(device)} torch={torch.__version__} x={rows_n}x{cols_n} {args.dtype} mode={mode}"
          f"{' + fused Triton' if with_fused else ''}, median of 5 rounds x {iters} calls")
    print(f"| case | path | time (µs) | host (µs) | GB/s | vs copy | vs {reference} | GPU (µs) | GPU vs copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    graph_cell = f"{copy_graph * 1e3:.1f} | 1.00" if copy_graph else " | "
    print(f"| device-to-device copy | | {copy_s * 1e6:.1f} | | {copy_gbs:.3g} | 1.00 | | {graph_cell} |")
    out = [dict(case="copy", path="", us=copy_s * 1e6, gbs=copy_gbs, gpu_us=copy_graph and copy_graph * 1e3)]
    for label, name, role, both in CASES:
        rec = _recipe(name)
        paths = [("triton", fused_setting)] if with_fused and isinstance(rec, fused_recipes) else []
        paths.append((reference, False))
        measured = []
        for path, setting in paths:
            with settings.override(torch_compile=compiled, fused_casts=setting):
                quantizer = make_quantizer(rec, role)
                quantizer.set_usage(rowwise=True, columnwise=both)
                moved = in_bytes + _output_bytes(quantizer(x))
                seconds, host = _queued(lambda: quantizer(x), device, warmup, iters)
                graph = timing.graph_ms(lambda: quantizer(x), iters) if cuda else None
            measured.append((path, seconds, host, moved, graph))
        ref_seconds = measured[-1][1]
        for path, seconds, host, moved, graph in measured:
            gbs = moved / seconds / 1e9
            gpu_vs_copy = copy_graph / graph * moved / (2 * in_bytes) if graph and copy_graph else None
            out.append(dict(case=label, path=path, us=seconds * 1e6, host_us=host * 1e6, gbs=gbs,
                            vs_copy=gbs / copy_gbs, gpu_us=graph and graph * 1e3, gpu_vs_copy=gpu_vs_copy))
            cell = f"{graph * 1e3:.1f} | {gpu_vs_copy:.2f}" if gpu_vs_copy else " | "
            print(f"| {label} | {path} | {seconds * 1e6:.1f} | {host * 1e6:.1f} | {gbs:.3g} | "
                  f"{gbs / copy_gbs:.2f} | {ref_seconds / seconds:.2f} | {cell} |", flush=True)
    return out


WEIGHT_CONFIGS = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8),
    "deepseek": dict(hidden=7168, ffn=2048, experts=64),
    "qwen3_235b": dict(hidden=4096, ffn=1536, experts=128),
    "gptoss": dict(hidden=2880, ffn=2880, experts=32),  # features off the 128 grid
}
BYTES_PER_ELEMENT = {"current": 6, "delayed": 4, "block": 4}
BLOCK_TILES = [(1, 64, 4), (1, 32, 4), (1, 64, 8), (2, 64, 8), (1, 128, 8), (2, 32, 4)]


def _tile_sweep(w, iters):
    """(family, tile, ms, same bytes as the default tile) of the 128x128 block cast's candidate tiles."""
    from te_dist.quantization import triton_casts as tc

    cast = lambda tile=None: tc.cast_fp8_blocks(w, 128, 128, torch.float8_e4m3fn, 448.0, True,  # noqa: E731
                                                rowwise=True, columnwise=True, tile=tile)
    ref, rows = cast(), []
    for tile in BLOCK_TILES:
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cast(tile), ref))
        rows.append(("128x128 blocks", tile, timing.each_call_ms(lambda: cast(tile), iters=iters), same))
    return rows


def _copy_gbs(numel: int, iters: int) -> float:
    """GB/s (read + written) of a device-to-device copy of ``numel`` bf16 elements: the baseline the GPU
    subcommands divide by, measured in the same process."""
    src = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 4 * numel / timing.each_call_ms(lambda: dst.copy_(src), iters=iters) / 1e6


def weights(args) -> list:
    from te_dist import settings
    from te_dist.ops import GroupedLinear
    from te_dist.recipe import recipe_from_name

    rows, sweeps = [], []
    for name in args.configs.split(","):
        c = WEIGHT_CONFIGS[name]
        E, H, F = c["experts"], c["hidden"], c["ffn"]
        ops = [GroupedLinear(E, H, 2 * F, dtype=torch.bfloat16, device="cuda"),
               GroupedLinear(E, F, H, dtype=torch.bfloat16, device="cuda")]
        numel = sum(op.weight.numel() for op in ops)
        copy_bw = _copy_gbs(numel, args.iters)
        for rname in args.recipes.split(","):
            # per-tensor recipes: also the one-pass CUDA cast (settings.cuda_rowcol_cast), labelled "+1pass"
            for one_pass in (False, True) if rname in ONE_PASS_RECIPES and not args.no_one_pass else (False,):
                label = rname + ("+1pass" if one_pass else "")
                with settings.override(cuda_rowcol_cast=one_pass):
                    for op in ops:
                        op.reset_recipe_state(recipe_from_name(rname))
                    ms = timing.each_call_ms(lambda: [op.quantized_weight() for op in ops], iters=args.iters)
                gb = BYTES_PER_ELEMENT[rname] * numel / 1e9
                rows.append(dict(config=name, recipe=label, ms=ms, gb=gb, of_bound=gb / ms * 1e3 / copy_bw,
                                 vs4=4 * numel / 1e9 / copy_bw * 1e3 / ms, copy_bw=copy_bw))
                print(f"row {name} {label} {ms:.3f} ms {rows[-1]['of_bound']:.2f} of bound", flush=True)
        if args.sweep:
            sweeps += [(name, *r) for r in _tile_sweep(ops[0].weight.detach(), args.iters)]
        del ops
        torch.cuda.empty_cache()
    print(f"\nExpert weight cast (fc1 + fc2), {torch.cuda.get_device_name()} (torch {torch.__version__})")
    print(f"{'config':<11} {'recipe':<14} {'ms':>8} {'floor GB':>10} {'of bound':>9} {'vs 4 B':>7} {'copy GB/s':>10}")
    for r in rows:
        print(f"{r['config']:<11} {r['recipe']:<14} {r['ms']:8.3f} {r['gb']:10.2f} {r['of_bound']:9.2f} "
              f"{r['vs4']:7.2f} {r['copy_bw']:10.0f}")
    if sweeps:
        print(f"\n{'config':<11} {'family':<22} {'tile':<14} {'fc1 ms':>8} {'same bytes':>10}")
        for name, family, tile, ms, same in sweeps:
            print(f"{name:<11} {family:<22} {str(tile):<14} {ms:8.3f} {str(same):>10}")
    return rows


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, but float32 sums (the probability gradient) up to their order."""
    if a.dtype == torch.float32:
        return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()) if b.numel() else 0.0))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def swiglu(args) -> list:
    from te_dist.ops.basic import swiglu_triton as st

    rows_out = []
    for shape in args.shapes.split(","):
        rows, F = (int(v) for v in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(rows + F)
        h = torch.randn(rows, 2 * F, device="cuda", dtype=torch.bfloat16, generator=g)
        probs = torch.rand(rows, device="cuda", generator=g)
        da = torch.randn(rows, F, device="cuda", dtype=torch.bfloat16, generator=g)
        copy_bw = _copy_gbs(rows * F * 2, args.iters)
        _, h8, hs = st.scaled_swiglu_forward_fp8(h, probs, None)
        former_fwd = (min(4, st.next_power_of_2(F // st.FP8_BLOCK)), 4)
        former_bwd = st.backward_launch(F, False)  # the 4-warp launch every backward took, bf16 h's today
        kernels = {  # name: (call with a launch shape, bytes moved at least once, former launch, today's)
            "forward, FP8 copy": (lambda s: st.scaled_swiglu_forward_fp8(h, probs, None, True, launch_shape=s),
                                  rows * F * (4 + 2 + 2) + hs.numel() * 4, former_fwd, st.forward_launch(F)),
            "backward, FP8 h": (lambda s: st.scaled_swiglu_backward(da, h8, probs, None, False, hs, torch.bfloat16, True,
                                                                    launch_shape=s),
                                rows * F * (2 + 2 + 4) + hs.numel() * 4, former_bwd, st.backward_launch(F, True)),
            "backward, bf16 h": (lambda s: st.scaled_swiglu_backward(da, h, probs, None, launch_shape=s),
                                 rows * F * (4 + 2 + 4 + 2), former_bwd, st.backward_launch(F, False)),
        }
        for name, (call, nbytes, former, today) in kernels.items():
            a, b = call(former), call(today)
            same = all(_same(x, y) for x, y in zip(a, b) if x is not None)
            ms = timing.interleaved_ms({"former": lambda: call(former), "today": lambda: call(today)},
                                       iters=args.iters, warmup=3, rounds=args.rounds)
            rows_out.append(dict(shape=shape, kernel=name, former_ms=ms["former"], today_ms=ms["today"],
                                 today_of_copy=nbytes / ms["today"] / 1e6 / copy_bw, same=same,
                                 launch=str(today)))
            print(f"row {shape} {name}: {ms['former']:.3f} -> {ms['today']:.3f} ms", flush=True)
        del h, da, h8, hs
        torch.cuda.empty_cache()
    print(f"\nFP8 SwiGLU kernels, {torch.cuda.get_device_name()}: former launch (4 warps) against today's")
    print(f"{'rows x F':<14} {'kernel':<18} {'former ms':>10} {'today ms':>9} {'speed-up':>9} {'of copy':>8} {'same':>5}")
    for r in rows_out:
        print(f"{r['shape']:<14} {r['kernel']:<18} {r['former_ms']:10.3f} {r['today_ms']:9.3f} "
              f"{r['former_ms'] / r['today_ms']:9.2f} {r['today_of_copy']:8.2f} {str(r['same']):>5}")
    return rows_out


def blocks(args) -> list:
    from te_dist.quantization import cuda_blocks

    fp8, fmt_max = torch.float8_e4m3fn, 448.0
    rows_out = []
    for spec in args.shapes.split(","):
        gathered = spec.endswith("g")
        rows, cols = (int(v) for v in spec.rstrip("g").split("x"))
        g = torch.Generator(device="cuda").manual_seed(rows + cols)
        source_rows = rows // 8 if gathered else rows
        x = torch.randn(source_rows, cols, device="cuda", dtype=torch.bfloat16, generator=g)
        idx = torch.randint(0, source_rows, (rows,), device="cuda", generator=g) if gathered else None
        nbytes = rows * cols * (2 + 2) + 2 * (rows * cols // 128) * 4
        copy_bw = _copy_gbs(rows * cols, args.iters)

        def cast(launch):
            return cuda_blocks.cast_blocks(x, fp8, fmt_max, True, col_scales_t=True, gather=idx, launch=launch)

        want = cast(0)
        launches = range(len(cuda_blocks.BLOCK_LAUNCHES))
        same = {n: all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cast(n), want))
                for n in launches}
        ms = timing.interleaved_ms({n: (lambda n=n: cast(n)) for n in launches}, iters=args.iters, warmup=3,
                                   rounds=args.rounds)
        for n in launches:
            rows_out.append(dict(shape=spec, launch=n, conversions=cuda_blocks.BLOCK_LAUNCHES[n], ms=ms[n],
                                 of_copy=nbytes / ms[n] / 1e6 / copy_bw, over_launch0=ms[0] / ms[n], same=same[n]))
        del x, idx, want
        torch.cuda.empty_cache()
    print(f"1x128 CUDA block cast, {torch.cuda.get_device_name()}: each launch (cuda_blocks.BLOCK_LAUNCHES: "
          + "; ".join(f"{n} {text}" for n, text in enumerate(cuda_blocks.BLOCK_LAUNCHES)) + ")")
    print(f"{'rows x C':<14} {'launch':>6} {'ms':>8} {'of copy':>8} {'launch 0/this':>13} {'same':>5}")
    for r in rows_out:
        print(f"{r['shape']:<14} {r['launch']:>6} {r['ms']:8.3f} {r['of_copy']:8.2f} {r['over_launch0']:13.2f} "
              f"{str(r['same']):>5}")
    return rows_out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("casts", help="every recipe's cast of one tensor against a copy")
    p.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--cols", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--eager", action="store_true", help="disable torch.compile of the cast functions")
    p.add_argument("--compile", action="store_true", help="compile the cast functions on any device (CPU too)")
    p.add_argument("--no-fused", action="store_true", help="skip the fused Triton rows")
    p.add_argument("--fused", action="store_true",
                   help="fused rows on any device (CPU: Triton's interpreter, TRITON_INTERPRET=1; logic only)")
    p = sub.add_parser("weights", help="(GPU) the expert weights' FP8 cast against the copy bandwidth")
    p.add_argument("--configs", default="mixtral,deepseek,qwen3_235b")
    p.add_argument("--recipes", default="current,delayed,block")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also the 128x128 block cast's candidate tiles")
    p.add_argument("--no-one-pass", action="store_true", help="skip the per-tensor recipes' one-pass CUDA cast rows")
    p = sub.add_parser("swiglu", help="(GPU) the FP8 SwiGLU kernels: today's launch against the former one")
    p.add_argument("--shapes", default="262144x1024,32768x14336,65536x768,131072x2944,50000x1536",
                   help="rows x F (F a multiple of 128): DeepSeek-like, Mixtral-like, Qwen3-30B-like, gpt-oss-like padded")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p = sub.add_parser("blocks", help="(GPU) the 1x128 CUDA block cast under each of its launches")
    p.add_argument("--shapes", default="266240x2048g,266240x1024,32768x32000,32768x2048",
                   help="rows x C (multiples of 128), g: rows gathered from rows/8 (DeepSeek-like step's casts)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    timing.add_json_option(*sub.choices.values())
    return parser


def main(argv=None) -> int:
    subcommands = {"casts": casts, "weights": weights, "swiglu": swiglu, "blocks": blocks}
    return timing.run_subcommand(build_parser(), subcommands, "quantize", argv)


if __name__ == "__main__":
    sys.exit(main())
