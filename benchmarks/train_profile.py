"""Where a `te-dist train` step's time goes, per recipe: the job's own model, loss and AdamW in one process.

    python benchmarks/train_profile.py --config launchers/configs/deepseek_like.yaml --recipes none,current,block
    python benchmarks/train_profile.py --unfused ...     # the loss on float32 logits and foreach AdamW

Per recipe (the FP8 ones with ``model.fp8_dense``, as ``benchmarks/train.py throughput --fp8-dense``): wall ms per
step over ``--steps`` after ``--warmup``, then torch.profiler over two more steps: kernel time per step summed by
kind (``KINDS``, the first whose words a kernel's name holds) and the ``--top`` heaviest kernels. On CPU the ops'
own CPU time stands in for kernel time (a check of the script, not a figure). One process, no torchrun: what the
job's step does on one rank, without its collectives.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time

import torch

# kinds of kernels by the words of their names, the first match wins (attention before GEMMs: cuDNN's flash
# kernels are wgmma GEMMs too; FP8 GEMMs before bf16 ones)
KINDS = (("attention", ("flash", "fmha", "sdpa")),
         ("fp8 gemm", ("fp8", "e4m3", "qqtst", "qrtst", "blockscaled")),
         ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "sm90_")),
         ("cast", ("cast", "quant", "amax", "transpose", "rowcol")),
         ("loss", ("_cross_entropy", "softmax", "nll", "log_")),
         ("optimizer", ("multi_tensor", "adam")),
         ("norm", ("norm",)),
         ("copy", ("copy", "cat", "index", "scatter", "gather", "sort", "cumsum")),
         ("elementwise", ("elementwise", "vectorized", "reduce", "fill")))


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, words in KINDS if any(w in lower for w in words)), "other")


def profile_recipe(config: str, recipe_name: str, *, device: torch.device, fused: bool, steps: int, warmup: int,
                   top: int) -> dict:
    from te_dist.autocast import autocast
    from te_dist.train.config import load_config, resolve_recipe
    from te_dist.train.model import build_model

    cfg = load_config(config)
    model_cfg = dataclasses.replace(cfg.model, fp8_dense=recipe_name != "none")
    model = build_model(model_cfg, seed=1, device=device)
    impl = {"fused": True} if fused and device.type == "cuda" else {"foreach": device.type == "cuda"}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **impl)
    recipe = resolve_recipe(None if recipe_name == "none" else recipe_name)
    B, S = cfg.data.global_batch_size, cfg.data.seq_len
    tokens = torch.randint(0, model_cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0)).to(device)
    targets = torch.roll(tokens, -1, 1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        with autocast(recipe=recipe):
            loss = model.loss(tokens, targets, fused=fused)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    ms = (time.perf_counter() - start) / steps * 1e3
    activity = torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(2):
            step()
        sync()
    per_kernel, per_kind = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        us = event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us > 0:
            per_kernel[event.key] += us / 2e3  # ms per step
            per_kind[kind_of(event.key)] += us / 2e3
    print(f"== {config} {recipe_name}: {ms:.2f} ms/step, {B * S / ms * 1e3:,.0f} tokens/s, kernels "
          f"{sum(per_kind.values()):.2f} ms\n   " + "  ".join(f"{k} {t:.2f}" for k, t in per_kind.most_common()))
    for name, t in per_kernel.most_common(top):
        print(f"   {t:7.2f}  {name[:150]}")
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ms_per_step": ms, "kinds_ms": dict(per_kind), "top_ms": per_kernel.most_common(top)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="launchers/configs/deepseek_like.yaml")
    p.add_argument("--recipes", default="none,current,block")
    p.add_argument("--device", default="cuda")
    p.add_argument("--unfused", action="store_true", help="train.fused_loss and train.fused_optimizer off")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    out = {r: profile_recipe(args.config, r, device=torch.device(args.device), fused=not args.unfused,
                             steps=args.steps, warmup=args.warmup, top=args.top) for r in args.recipes.split(",")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
