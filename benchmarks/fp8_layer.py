"""The FP8 MoE layer in a training step: weights written by the optimizer every step, so the weight cast is paid.

    python benchmarks/fp8_layer.py [--configs mixtral,deepseek,qwen3_235b,qwen3_30b,gptoss]
                                   [--recipes current,delayed,block] [--micro-batches 1,4] [--fixed]
                                   [--pad-off-grid]

One optimizer step = M micro-batches of ``MoELayer`` forward + backward (EP=1, one GPU), gradients
accumulated, then ``torch.optim.AdamW(fused=True)`` writes the weights (through no version bump: the
case the FP8 weight copy must follow). With M > 1 the first micro-batch casts the FP8 weights and the
others reuse them (``is_first_microbatch``, docs/quantization.md); with M = 1 every forward casts.
Every arm (bf16 and each recipe) runs the same loop on the same layer, inputs and optimizer.

Columns per (config, recipe, M): the median over --iters optimizer steps (after --warmup) of
  * ``mb ms``: fwd + bwd (+ the weight cast) per micro-batch, the optimizer left out;
  * ``vs bf16``: bf16's ``mb ms`` over this arm's (the issue's headline ratio);
  * ``+opt vs bf16``: the same ratio with the optimizer step's time counted (per micro-batch share);
  * ``charged``: bf16's ``mb ms`` over this arm's plus its optimizer step's extra time over bf16's (per micro-batch;
    a faster step is not credited): the fair figure of a ``:copies`` row, whose cast moved into the step;
  * ``path``: native (the quantized grouped kernels ran) or emulated (fake-quantize, then bf16);
  * ``diff``: the arm's first output against bf16's on the same weights (relative Frobenius).
``--optimizer-copies`` adds a ``<recipe>:copies`` row per M for delayed, block and current in --recipes:
``te_dist.optim.AdamWWithFP8Copies`` writes the expert weights' FP8 copies in its update and every step's first
forward takes them (no cast in the micro-batches; the copies' writes in the optimizer's time: ``charged`` or
``+opt`` is the fair figure for that row).
``--wgrad-accumulation`` adds a ``<recipe>:acc`` row per M > 1: the experts' ``fuse_wgrad_accumulation`` set and
``te_dist.settings.fp8_wgrad_accumulation`` on, so micro-batches after the first add their FP8 weight gradients into
``.grad`` in the wgrad kernel's epilogue (docs/quantization.md "Gradient accumulation in the wgrad"); the bf16 arm
keeps autograd's add (torch's grouped GEMM adds into nothing). With both options, ``<recipe>:copies+acc`` rows (M > 1)
take both, as ``te-dist train`` does by default.
``--fixed`` adds a labelled row per recipe with the weights never written and the copy reused by
every forward (the old fixed-weight figure; not a training step).
``te_dist.settings.fp8_pad_off_grid`` (on by default; ``TE_DIST_FP8_PAD_OFF_GRID=0`` turns it off, ``--pad-off-grid``
forces it on): the gpt-oss-like experts (features of 2880, off the FP8 kernels' 128 grid) take the native path
zero padded to the grid, else the emulated one; the header and the JSON rows say which was in force.

Configs (expert shapes; tokens per micro-batch): Mixtral-like (H 4096, F 14336, E 8, top-2, 4096),
DeepSeek-like (H 7168, F 2048, E 64, top-8, 4096), Qwen3-235B-like (H 4096, F 1536, E 128, top-8,
8192), Qwen3-30B-like (H 2048, F 768, E 128, top-8, 8192), gpt-oss-like (H 2880, F 2880, E 32, top-4,
4096). Timing: CUDA events around each phase, steps queued back to back.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

import timing  # noqa: I001 - first: this checkout's te_dist on the path
import te_dist as td
from te_dist.moe import MoELayer
from te_dist.ops.basic.wgrad_accumulation import set_fuse_wgrad_accumulation
from te_dist.optim import AdamWWithFP8Copies
from te_dist.recipe import recipe_from_name

CONFIGS = {
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, top_k=2, tokens=4096),
    "deepseek": dict(hidden=7168, ffn=2048, experts=64, top_k=8, tokens=4096),
    "qwen3_235b": dict(hidden=4096, ffn=1536, experts=128, top_k=8, tokens=8192),
    "qwen3_30b": dict(hidden=2048, ffn=768, experts=128, top_k=8, tokens=8192),
    "gptoss": dict(hidden=2880, ffn=2880, experts=32, top_k=4, tokens=4096),
}


class Arm:
    """One recipe's training loop on a shared layer: its own optimizer state, the same inputs."""

    def __init__(self, layer, recipe, micro_batches, fixed=False, copies=False, accumulate=False):
        self.layer, self.recipe, self.micro, self.fixed, self.copies = layer, recipe, micro_batches, fixed, copies
        # the switch for the arm's whole run (no new settings generation per micro-batch); the layer is shared, so
        # every arm sets its own word
        td.settings.set_for_process(fp8_wgrad_accumulation=accumulate)
        set_fuse_wgrad_accumulation(layer, accumulate)
        params = [p for p in layer.parameters() if p.requires_grad]
        # copies: the update writes the expert weights' copies, which the next step's first forward takes
        self.optimizer = None if fixed else AdamWWithFP8Copies(params, lr=1e-5, fused=True, copies_of=[layer]) \
            if copies else torch.optim.AdamW(params, lr=1e-5, fused=True)
        layer.is_first_microbatch = True if fixed else None  # fixed: cast once, then reuse (nothing writes)

    def step(self, xs, grads, events):
        """One optimizer step; ``events``: (start, after the micro-batches, after the optimizer)."""
        layer = self.layer
        events[0].record()
        out = None
        for i, (x, g) in enumerate(zip(xs, grads)):
            if (self.micro > 1 or self.copies) and not self.fixed:
                layer.is_first_microbatch = i == 0
            with td.autocast(recipe=self.recipe):
                y = layer(x)
            y.backward(g)
            out = y if out is None else out
        events[1].record()
        if self.optimizer is not None:
            with td.settings.override(fp8_optimizer_copies=self.copies, fp8_optimizer_copies_current=self.copies,
                                      fp8_optimizer_copies_padded=self.copies):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            layer.zero_grad(set_to_none=True)
        events[2].record()
        return out


def profile_arm(arm, xs, grads, iters, warmup, top):
    """Print the arm's ``top`` heaviest GPU kernels per micro-batch (ms), summed over ``iters`` steps."""
    for _ in range(warmup):
        arm.step(xs, grads, [torch.cuda.Event(enable_timing=True) for _ in range(3)])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            arm.step(xs, grads, [torch.cuda.Event(enable_timing=True) for _ in range(3)])
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: -e.device_time_total)
    scale = 1e3 * iters * arm.micro
    total = sum(e.device_time_total for e in kernels) / scale
    print(f"  GPU kernel time per micro-batch (optimizer included): {total:.3f} ms")
    for e in kernels[:top]:
        print(f"  {e.device_time_total / scale:8.3f} ms {e.count // iters:5d}x  {e.key[:110]}")


def run_arm(arm, xs, grads, iters, warmup):
    """(median fwd+bwd ms per micro-batch, median optimizer ms per step, the first output's difference from
    bf16 on the same weights, native path ran)."""
    with torch.no_grad():
        ref = arm.layer(xs[0]).float()
    first = None
    for _ in range(warmup):
        y = arm.step(xs, grads, [torch.cuda.Event(enable_timing=True) for _ in range(3)])
        first = y.detach() if first is None else first
    diff = ((first.float() - ref).norm() / ref.norm()).item()
    torch.cuda.synchronize()
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    for events in marks:
        arm.step(xs, grads, events)
    torch.cuda.synchronize()
    mb = statistics.median(a.elapsed_time(b) for a, b, _ in marks) / arm.micro
    opt = statistics.median(b.elapsed_time(c) for _, b, c in marks)
    native = arm.recipe is not None and arm.layer.fc1.has_native_weight_copy
    return mb, opt, diff, native


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="mixtral,deepseek,qwen3_235b,qwen3_30b,gptoss")
    p.add_argument("--recipes", default="current,delayed,block")
    p.add_argument("--micro-batches", default="1,4")
    p.add_argument("--fixed", action="store_true", help="add the fixed-weight rows (weights never written)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="instead of the table: each arm's N heaviest GPU kernels over --iters steps (torch.profiler)")
    p.add_argument("--optimizer-copies", action="store_true",
                   help="add a <recipe>:copies row per M (delayed, block, current): te_dist.optim."
                        "AdamWWithFP8Copies writes the expert weights' FP8 copies with its update "
                        "(te_dist.settings.fp8_optimizer_copies, _current, _padded), every step's first forward "
                        "takes them; its optimizer time is in +opt")
    p.add_argument("--wgrad-accumulation", action="store_true",
                   help="add a <recipe>:acc row per M > 1: FP8 wgrads of later micro-batches add into .grad in the "
                        "kernel's epilogue (fuse_wgrad_accumulation, te_dist.settings.fp8_wgrad_accumulation)")
    p.add_argument("--pad-off-grid", action="store_true",
                   help="te_dist.settings.fp8_pad_off_grid on (the default) whatever the environment says")
    timing.add_json_option(p)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    switch = td.settings.override(fp8_pad_off_grid=True) if args.pad_off_grid else contextlib.nullcontext()
    with switch:
        pad_off_grid = td.settings.fp8_pad_off_grid
        rows = run_configs(args, pad_off_grid)
    print(f"\nMoELayer training step, EP=1, {torch.cuda.get_device_name()} (torch {torch.__version__}), "
          f"fp8_pad_off_grid={pad_off_grid}")
    print(f"{'config':<11} {'recipe':<14} {'M':>2} {'mb ms':>8} {'opt ms':>8} {'vs bf16':>8} {'charged':>8} "
          f"{'+opt vs bf16':>12} {'path':>9} {'diff':>8}")
    for r in rows:
        print(f"{r['config']:<11} {r['recipe']:<14} {r['micro_batches']:>2} {r['mb_ms']:8.2f} {r['opt_ms']:8.2f} "
              f"{r['speed']:7.2f}x {r['charged']:7.2f}x {r['speed_opt']:11.2f}x {r['path']:>9} {r['diff']:8.1e}")
    timing.write_json(args.json, rows, benchmark="fp8_layer")


def charged_speed(base: tuple, mb: float, opt: float, micro: int) -> float:
    """bf16's micro-batch time over this arm's with its optimizer step's extra time over bf16's charged per
    micro-batch (``base``: bf16's (mb, opt) ms); a step faster than bf16's is not credited."""
    return base[0] / (mb + max(0.0, opt - base[1]) / micro)


def run_configs(args, pad_off_grid: bool) -> list:
    """One row per (config, M, arm) that ran."""
    rows = []
    for name in args.configs.split(","):
        c = CONFIGS[name]
        torch.manual_seed(0)
        layer = MoELayer(c["hidden"], c["ffn"], c["experts"], c["top_k"], dtype=torch.bfloat16, device="cuda")
        for micro in map(int, args.micro_batches.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(1)
            xs = [torch.randn(c["tokens"], c["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(micro)]
            grads = [torch.randn_like(x) for x in xs]
            arms = [("bf16", None, False)] + [(r, r, False) for r in args.recipes.split(",")]
            if args.fixed and micro == 1:
                arms += [(f"{r}:fixed", r, True) for r in args.recipes.split(",")]
            if args.optimizer_copies:
                arms += [(f"{r}:copies", r, "copies") for r in args.recipes.split(",")
                         if r in ("delayed", "block", "current")]
            if args.wgrad_accumulation and micro > 1:
                arms += [(f"{r}:acc", r, "acc") for r in args.recipes.split(",")]
                if args.optimizer_copies:  # both, as te-dist train runs them by default
                    arms += [(f"{r}:copies+acc", r, "copies+acc") for r in args.recipes.split(",")
                             if r in ("delayed", "block", "current")]
            base = None
            for label, rname, kind in arms:
                recipe = None if rname is None else recipe_from_name(rname)
                arm = Arm(layer, recipe, micro, fixed=kind is True, copies=kind in ("copies", "copies+acc"),
                          accumulate=kind in ("acc", "copies+acc"))
                if args.profile:
                    print(f"profile {name} {label} M={micro}", flush=True)
                    profile_arm(arm, xs, grads, args.iters, args.warmup, args.profile)
                    continue
                try:
                    mb, opt, diff, native = run_arm(arm, xs, grads, args.iters, args.warmup)
                except Exception as exc:  # one arm's failure is a row, not the end of the table
                    print(f"row {name} {label} M={micro} failed: {exc!r:.300}", flush=True)
                    continue
                if base is None:
                    base = (mb, opt)
                row = dict(config=name, recipe=label, micro_batches=micro, mb_ms=mb, opt_ms=opt, speed=base[0] / mb,
                           charged=charged_speed(base, mb, opt, micro),
                           speed_opt=(base[0] + base[1] / micro) / (mb + opt / micro),
                           path="-" if recipe is None else ("native" if native else "emulated"), diff=diff,
                           pad_off_grid=pad_off_grid)
                rows.append(row)
                print(f"row {name} {label} M={micro} {row['speed']:.3f}x (+opt {row['speed_opt']:.3f}x) "
                      f"{row['path']}", flush=True)
        del layer
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
