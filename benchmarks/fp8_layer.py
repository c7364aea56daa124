"""MoELayer forward+backward under each FP8 recipe against the same layer in bf16 (EP=1, one GPU).

    python benchmarks/fp8_layer.py [--configs mixtral,deepseek,qwen3] [--recipes current,delayed,block]

A recipe name with the suffix ``:bf16h`` (e.g. ``block:bf16h``) runs that recipe with
``fp8_swiglu_input = False``: the grouped MLP keeps the SwiGLU input in bf16 instead of its FP8 copy.
The suffix ``:tables`` (per-tensor recipes, e.g. ``current:tables``) runs their GEMMs on the
block-scaled kernels with each one scale broadcast into block tables per call, the A/B baseline of
the tensor-scaled kernels. The suffix ``:c<N>`` (e.g. ``block:c4``) runs every FP8 grouped GEMM on
tile config N (``cutlass_kernels.fp8_block.FP8_CONFIGS``), a same-run A/B of a tile. The suffix
``:grouped`` keeps every FP8 GEMM on the grouped kernels (no cuBLAS per expert,
``te_dist/backends/fp8_selection.py``): the A/B of that choice. ``:tables`` and ``:c<N>`` keep them
there too, since they compare variants of those kernels. The suffix ``:w<N>`` runs every wgrad on tile
config N and leaves fwd and dgrad as chosen (``fp8_block.WGRAD_CONFIG``). The suffix ``:loop<G>`` (e.g.
``current:loop25``) moves both of ``fp8_selection``'s per-expert thresholds to G GFLOP: the same-run A/B
of where cuBLAS per expert takes over. The suffix ``:copy`` has the dispatcher copy the expert rows
(``te_dist.moe.layer.GATHER_IN_EXPERTS = False``) instead of leaving the gather to the first GEMM,
which under per-tensor recipes gathers FP8 bytes of the quantized tokens (te_dist.ops.RowGather).

Rows: one per (config, recipe). Columns: step time (median of --iters steps after --warmup, one
forward+backward each, queued back to back, a CUDA event between steps; "max" is the slowest step,
so a stall in the timed steps shows instead of moving the figure), speed against bf16 in the same
run (bf16 time / recipe time), memory held for backward (allocated after the forward minus before it) against bf16's,
the path the fused grouped MLP took (native: the quantized grouped kernels, emulated:
fake-quantize then bf16) and the loss-free output difference against bf16 (relative Frobenius).
Configs are the issue's: Mixtral-like (H 4096, F 14336, 8 experts, top-2, 4096 tokens),
DeepSeek-like (H 7168, F 2048, 64 experts, top-8, 4096 tokens), Qwen3-30B-like (H 2048, F 768,
128 experts, top-8, 8192 tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import te_dist as td
from cutlass_kernels import fp8_block
from te_dist.backends import fp8_selection
from te_dist.moe import MoELayer
from te_dist.moe import layer as moe_layer
from te_dist.recipe import recipe_from_name

from scale_tables import scale_tables  # beside this file: the script's directory is on sys.path

CONFIGS = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2, tokens=4096),
    "deepseek": dict(hidden=7168, ffn=2048, experts=64, top_k=8, tokens=4096),
    "qwen3": dict(hidden=2048, ffn=768, experts=128, top_k=8, tokens=8192),
}


def step_stats(layer, x, recipe, iters, warmup):
    def step():
        layer.zero_grad(set_to_none=True)  # as a training loop does: backward assigns, no accumulation
        x.grad = None
        with td.autocast(recipe=recipe):
            y = layer(x)
        y.backward(grad)
        return y

    grad = torch.randn_like(x)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        y = step()
        events[i + 1].record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    ms, slowest = statistics.median(times), max(times)
    # memory held between forward and backward
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with td.autocast(recipe=recipe):
        y2 = layer(x)
    held = torch.cuda.memory_allocated() - before
    y2.backward(grad)
    native = layer.fc1.has_native_weight_copy
    return ms, slowest, held, y.detach(), native


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="mixtral,deepseek,qwen3")
    p.add_argument("--recipes", default="current,delayed,block")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for name in args.configs.split(","):
        c = CONFIGS[name]
        torch.manual_seed(0)
        layer = MoELayer(c["hidden"], c["ffn"], c["experts"], c["top_k"], dtype=torch.bfloat16, device="cuda")
        x = torch.randn(c["tokens"], c["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        base_ms, base_max, base_held, base_y, _ = step_stats(layer, x, None, args.iters, args.warmup)
        rows.append(dict(config=name, recipe="bf16", ms=base_ms, max_ms=base_max, speed=1.0, held_gb=base_held / 1e9,
                         mem=1.0, path="-", diff=0.0))
        for rname in args.recipes.split(","):
            base_name, _, option = rname.partition(":")
            recipe = recipe_from_name(base_name)
            config = None
            wgrad_config = fp8_block.WGRAD_CONFIG
            loop_gflop = None
            if option == "bf16h":
                recipe.fp8_swiglu_input = False
            elif option.startswith("c") and option[1:].isdigit():
                config = int(option[1:])
            elif option.startswith("w") and option[1:].isdigit():
                wgrad_config = int(option[1:])
            elif option.startswith("loop") and option[4:].isdigit():
                loop_gflop = int(option[4:])
            elif option not in ("", "tables", "grouped", "copy"):
                raise SystemExit(f"unknown recipe option {option!r} in {rname!r} (known: bf16h, tables, grouped, copy, "
                                 "c<N>, w<N>, loop<G>)")
            fp8_block.CONFIG_OVERRIDE = config
            default_wgrad, fp8_block.WGRAD_CONFIG = fp8_block.WGRAD_CONFIG, wgrad_config
            loop_min = fp8_selection.LOOP_MIN_FLOP_PER_EXPERT, fp8_selection.LOOP_MIN_FLOP_PER_EXPERT_BLOCK
            if option in ("grouped", "tables") or config is not None:
                fp8_selection.LOOP_MIN_FLOP_PER_EXPERT = fp8_selection.LOOP_MIN_FLOP_PER_EXPERT_BLOCK = float("inf")
            elif loop_gflop is not None:
                fp8_selection.LOOP_MIN_FLOP_PER_EXPERT = fp8_selection.LOOP_MIN_FLOP_PER_EXPERT_BLOCK = loop_gflop * 1e9
            moe_layer.GATHER_IN_EXPERTS = option != "copy"
            try:
                with scale_tables(option == "tables"):
                    ms, slowest, held, y, native = step_stats(layer, x, recipe, args.iters, args.warmup)
            finally:
                fp8_block.CONFIG_OVERRIDE = None
                fp8_block.WGRAD_CONFIG = default_wgrad
                fp8_selection.LOOP_MIN_FLOP_PER_EXPERT, fp8_selection.LOOP_MIN_FLOP_PER_EXPERT_BLOCK = loop_min
                moe_layer.GATHER_IN_EXPERTS = True
            diff = ((y.float() - base_y.float()).norm() / base_y.float().norm()).item()
            rows.append(dict(config=name, recipe=rname, ms=ms, max_ms=slowest, speed=base_ms / ms,
                             held_gb=held / 1e9, mem=held / max(base_held, 1), path="native" if native else "emulated",
                             diff=diff))
            print(f"row {name} {rname} {base_ms / ms:.3f}x mem {held / max(base_held, 1):.3f}", flush=True)
        del layer, x
        torch.cuda.empty_cache()
    print(f"\nMoELayer fwd+bwd, EP=1, {torch.cuda.get_device_name()} (torch {torch.__version__})")
    print(f"{'config':<9} {'recipe':<12} {'ms':>8} {'max':>8} {'vs bf16':>8} {'held GB':>8} {'mem/bf16':>8} "
          f"{'path':>9} {'diff':>8}")
    for r in rows:
        print(f"{r['config']:<9} {r['recipe']:<12} {r['ms']:8.2f} {r['max_ms']:8.2f} {r['speed']:7.2f}x "
              f"{r['held_gb']:8.2f} {r['mem']:8.2f} {r['path']:>9} {r['diff']:8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
