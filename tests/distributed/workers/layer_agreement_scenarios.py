"""MoELayer agreement scenarios, run on every rank under torchrun (gloo on CPU, or NCCL with --backend nccl).

Each scenario builds EP layers over the world (the last rank differs where the scenario says so),
runs forwards, and prints one ``RESULT <name> <json>`` line that the launching test compares across
ranks. Scenarios run back to back in one process group: a mismatch must raise on every rank before
any token all-to-all, or the next scenario's collectives would desynchronise and the launch time out.

    python -m torch.distributed.run --nproc-per-node 2 layer_agreement_scenarios.py --scenarios equal,experts
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import te_dist as td
from te_dist import recipe as R
from te_dist.distributed import layer_agreement
from te_dist.distributed.layer_agreement import LayerMismatchError
from te_dist.moe import MoELayer, RoutingError
from worker_env import init_worker

# Counters of the collectives the scenarios must account for (patched module attributes).
CALLS = {"agree": 0, "all_to_all": 0}
_agree_key = layer_agreement.agree_key
_all_to_all_single = dist.all_to_all_single


def _counting_agree(*args, **kwargs):
    CALLS["agree"] += 1
    return _agree_key(*args, **kwargs)


def _counting_all_to_all(*args, **kwargs):
    CALLS["all_to_all"] += 1
    return _all_to_all_single(*args, **kwargs)


layer_agreement.agree_key = _counting_agree
dist.all_to_all_single = _counting_all_to_all

BASE = dict(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, activation="swiglu")


def emit(name: str, **payload) -> None:
    print(f"RESULT {name} {json.dumps(payload, sort_keys=True)}", flush=True)


def build(args, **overrides):
    opts = dict(BASE, dtype=args.dtype)
    opts.update(overrides)
    torch.manual_seed(0)
    return MoELayer(opts.pop("hidden_size"), opts.pop("ffn_hidden_size"), opts.pop("num_experts"), opts.pop("top_k"),
                    ep_group=dist.group.WORLD, device=args.device, **opts)


def tokens(layer, rank, num_tokens=12):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(num_tokens, layer.hidden_size, generator=g).to(layer.fc1.weight.device, layer.dtype)


def run_forward(layer, x, recipe=None):
    """Forward under ``autocast(recipe)`` without a group; the error (if any) as a dict."""
    before = dict(CALLS)
    try:
        with td.autocast(recipe=recipe):
            out = layer(x)
        error = None
        finite = bool(torch.isfinite(out).all())
    except (LayerMismatchError, RoutingError) as exc:
        error = {"type": type(exc).__name__, "message": str(exc),
                 "mismatched": getattr(exc, "mismatched_ranks", None), "fields": getattr(exc, "fields", None)}
        finite = None
    calls = {k: CALLS[k] - before[k] for k in CALLS}
    return error, finite, calls


# --------------------------------------------------------------------------- scenarios


def scenario_equal(args, rank, world):
    """Identical layers: one agreement at the first forward, none after, tokens move every step."""
    layer = build(args)
    steps = [run_forward(layer, tokens(layer, rank)) for _ in range(3)]
    emit("equal", errors=[s[0] for s in steps], finite=[s[1] for s in steps], calls=[s[2] for s in steps],
         transport=layer.dispatcher.transport)


# Each mismatch: (overrides on the last rank, recipe on rank 0, recipe on the last rank).
MISMATCHES = {
    "experts": dict(num_experts=8),
    "hidden": dict(hidden_size=32),
    "ffn": dict(ffn_hidden_size=12),
    "top_k": dict(top_k=1),
    "activation": dict(activation="gelu"),
    "dtype": dict(dtype="other"),
}


def _mismatch(name, args, rank, world, overrides, recipe0=None, recipe_last=None):
    last = rank == world - 1
    if overrides.get("dtype") == "other":
        overrides = dict(overrides, dtype=torch.bfloat16 if args.dtype != torch.bfloat16 else torch.float32)
    layer = build(args, **(overrides if last else {}))
    error, _, calls = run_forward(layer, tokens(layer, rank), recipe_last if last else recipe0)
    emit(name, error=error, calls=calls)


def _make_mismatch(name):
    return lambda args, rank, world: _mismatch(name, args, rank, world, MISMATCHES[name])


def scenario_recipe_field(args, rank, world):
    """autocast without a group: rank 0 and the last rank run Float8CurrentScaling with different settings."""
    recipe = R.Float8CurrentScaling(use_power_2_scales=rank == world - 1)
    _mismatch("recipe_field", args, rank, world, {}, recipe, recipe)


def scenario_recipe_none(args, rank, world):
    """A recipe on rank 0, none on the last rank."""
    _mismatch("recipe_none", args, rank, world, {}, R.Float8CurrentScaling(), None)


def scenario_midtrain(args, rank, world):
    """The last rank writes a recipe setting before step 2: every rank raises at step 2, none hangs."""
    layer = build(args)
    recipe = R.Float8CurrentScaling()
    steps = []
    for step in range(4):
        if step == 2 and rank == world - 1:
            recipe.use_power_2_scales = True
        error, finite, calls = run_forward(layer, tokens(layer, rank), recipe)
        steps.append({"step": step, "error": error, "calls": calls})
        if error:
            break
    emit("midtrain", steps=steps)


def scenario_all_change(args, rank, world):
    """Every rank writes the same setting before step 2: agreed again once, no error."""
    layer = build(args)
    recipe = R.Float8CurrentScaling()
    steps = []
    for step in range(4):
        if step == 2:
            recipe.use_power_2_scales = True
        error, finite, calls = run_forward(layer, tokens(layer, rank), recipe)
        steps.append({"step": step, "error": error, "calls": calls, "finite": finite})
    emit("all_change", steps=steps)


def scenario_inf(args, rank, world):
    """inf in the last rank's hidden states: every rank raises the routing error, then the group still works."""
    layer = build(args)
    x = tokens(layer, rank)
    if rank == world - 1:
        x[3] = 0.0
        x[3, 1] = float("inf")  # +-inf logits, no NaN
    error, _, _ = run_forward(layer, x)
    after, finite, _ = run_forward(layer, tokens(layer, rank))
    emit("inf", error=error, after=after, finite_after=finite)


SCENARIOS = {
    "equal": scenario_equal,
    **{name: _make_mismatch(name) for name in MISMATCHES},
    "recipe_field": scenario_recipe_field,
    "recipe_none": scenario_recipe_none,
    "midtrain": scenario_midtrain,
    "all_change": scenario_all_change,
    "inf": scenario_inf,
}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios", required=True, help=f"comma list of {sorted(SCENARIOS)}")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--gloo-cuda", action="store_true",
                        help="gloo with the layers on CUDA (ranks may share one GPU): the tag on the device")
    args = parser.parse_args(argv)
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; expected some of {sorted(SCENARIOS)}")
    args.device, args.dtype = init_worker(args.backend, cpu_dtype=torch.float32, gpu_dtype=torch.bfloat16)
    if args.gloo_cuda:
        args.device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in names:
        SCENARIOS[name](args, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
