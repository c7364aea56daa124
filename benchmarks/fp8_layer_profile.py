"""Where one MoELayer step's GPU time goes, per kernel, under a recipe (torch.profiler; one GPU).

    python benchmarks/fp8_layer_profile.py --config deepseek --recipe block [--rows 30]

Prints the kernels sorted by total CUDA time over --iters steps, and the step's CPU and GPU time,
so a gap between the FP8 GEMMs' speed-up and the layer's is traced to the kernels that cause it.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import te_dist as td
from te_dist.moe import MoELayer
from te_dist.recipe import recipe_from_name

from fp8_layer import CONFIGS


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="deepseek")
    p.add_argument("--recipe", default="block")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args()
    c = CONFIGS[args.config]
    torch.manual_seed(0)
    layer = MoELayer(c["hidden"], c["ffn"], c["experts"], c["top_k"], dtype=torch.bfloat16, device="cuda")
    x = torch.randn(c["tokens"], c["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    recipe = recipe_from_name(args.recipe)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with td.autocast(recipe=recipe):
            y = layer(x)
        y.backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
    print(f"== {args.config} / {args.recipe}: per {args.iters} steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
