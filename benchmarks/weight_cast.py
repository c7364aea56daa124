"""The expert weights' FP8 cast (every optimizer step in training) against the memory bound, per recipe.

    python benchmarks/weight_cast.py [--configs mixtral,deepseek,qwen3_235b] [--recipes current,delayed,block]
                                     [--sweep]

Times ``GroupedLinear.quantized_weight()``, the whole path a training forward runs (the quantizer's
kernels and the GEMM layouts: both copies, scales), for the fc1 [E, 2F, H] and fc2 [E, H, F] weights of
each config, against a device-to-device copy of the same bf16 weights measured in the same run.

Columns: ``ms`` (median of --iters calls, CUDA events, after a warm-up); ``floor GB`` = the bytes the
recipe must move at least (per-tensor current scaling: an amax read of the weight, then one pass reading
it and writing both FP8 layouts = 6 bytes per element; delayed scaling: the cast with the last step's
scale writing both layouts, amax recorded = 4; 128x128 blocks: one pass = 4, plus the scales); ``of
bound`` = (floor GB / ms) / the copy's (read + written) bandwidth: the goal is >= 0.8; ``vs 4 B`` = the
time of moving 4 bytes per element at copy bandwidth (read bf16 once, write both layouts) over ``ms``.
``--sweep`` also times the candidate tiles of the 128x128 block cast (``tile=``), each checked against
the default tile's bytes first.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from te_dist.ops import GroupedLinear
from te_dist.quantization import triton_casts as tc
from te_dist.recipe import recipe_from_name

CONFIGS = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8),
    "deepseek": dict(hidden=7168, ffn=2048, experts=64),
    "qwen3_235b": dict(hidden=4096, ffn=1536, experts=128),
}
BYTES_PER_ELEMENT = {"current": 6, "delayed": 4, "block": 4}
BLOCK_TILES = [(1, 64, 4), (1, 32, 4), (1, 64, 8), (2, 64, 8), (1, 128, 8), (2, 32, 4)]


def timed(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * iters)]
    for i in range(iters):
        ev[2 * i].record()
        fn()
        ev[2 * i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in range(iters))


def weights(c):
    """(name, GroupedLinear) of one config's two expert GEMMs."""
    E, H, F = c["experts"], c["hidden"], c["ffn"]
    return [("fc1", GroupedLinear(E, H, 2 * F, dtype=torch.bfloat16, device="cuda")),
            ("fc2", GroupedLinear(E, F, H, dtype=torch.bfloat16, device="cuda"))]


def sweep(w, iters):
    """Rows (family, tile, ms) of the candidate tiles; every candidate's bytes equal the default's."""
    fp8, fmax = torch.float8_e4m3fn, 448.0
    rows = []
    ref = tc.cast_fp8_blocks(w, 128, 128, fp8, fmax, True, rowwise=True, columnwise=True)
    for tile in BLOCK_TILES:
        out = tc.cast_fp8_blocks(w, 128, 128, fp8, fmax, True, rowwise=True, columnwise=True, tile=tile)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out, ref))
        ms = timed(lambda: tc.cast_fp8_blocks(w, 128, 128, fp8, fmax, True, rowwise=True, columnwise=True,
                                              tile=tile), iters)
        rows.append(("128x128 blocks", tile, ms, same))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="mixtral,deepseek,qwen3_235b")
    p.add_argument("--recipes", default="current,delayed,block")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    rows, sweeps = [], []
    for name in args.configs.split(","):
        ops = weights(CONFIGS[name])
        numel = sum(op.weight.numel() for _, op in ops)
        src = torch.cat([op.weight.detach().reshape(-1) for _, op in ops])
        dst = torch.empty_like(src)
        copy_ms = timed(lambda: dst.copy_(src), args.iters)
        copy_bw = 4 * numel / copy_ms / 1e6  # GB/s, bytes read + written
        del src, dst
        for rname in args.recipes.split(","):
            for _, op in ops:
                op.reset_recipe_state(recipe_from_name(rname))
            ms = timed(lambda: [op.quantized_weight() for _, op in ops], args.iters)
            gb = BYTES_PER_ELEMENT[rname] * numel / 1e9
            rows.append(dict(config=name, recipe=rname, ms=ms, gb=gb, of_bound=gb / ms * 1e3 / copy_bw,
                             vs4=4 * numel / 1e9 / copy_bw * 1e3 / ms, copy_bw=copy_bw))
            print(f"row {name} {rname} {ms:.3f} ms {rows[-1]['of_bound']:.2f} of bound", flush=True)
        if args.sweep:
            sweeps += [(name, *r) for r in sweep(ops[0][1].weight.detach(), args.iters)]
        del ops
        torch.cuda.empty_cache()
    print(f"\nExpert weight cast (fc1 + fc2), {torch.cuda.get_device_name()} (torch {torch.__version__})")
    print(f"{'config':<11} {'recipe':<8} {'ms':>8} {'floor GB':>10} {'of bound':>9} {'vs 4 B':>7} {'copy GB/s':>10}")
    for r in rows:
        print(f"{r['config']:<11} {r['recipe']:<8} {r['ms']:8.3f} {r['gb']:10.2f} {r['of_bound']:9.2f} "
              f"{r['vs4']:7.2f} {r['copy_bw']:10.0f}")
    if sweeps:
        print(f"\n{'config':<11} {'family':<22} {'tile':<14} {'fc1 ms':>8} {'same bytes':>10}")
        for name, family, tile, ms, same in sweeps:
            print(f"{name:<11} {family:<22} {str(tile):<14} {ms:8.3f} {str(same):>10}")


if __name__ == "__main__":
    main()
