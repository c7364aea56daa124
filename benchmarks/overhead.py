"""Host overhead of te_dist's per-call machinery, each against its floor or plain torch in the same run.

    python benchmarks/overhead.py recipe      # cached str(recipe) against a rebuild, every recipe class
    python benchmarks/overhead.py support     # support predicates cached / uncached, routing per forward
    python benchmarks/overhead.py fuser       # plan lookup, a 4-op Sequential, the grouped expert MLP
    python benchmarks/overhead.py mlp-host    # (GPU) host time of a quantized expert-MLP step over bf16's
    python benchmarks/overhead.py consensus   # recipe consensus per training step (2 ranks under torchrun)

Every subcommand takes ``--json PATH``. Goals: docs/benchmarks.md (Recipe string, Support predicates,
Fuser overhead, FP8 expert MLP's host time, Recipe consensus).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import subprocess
import sys
import time

import torch

import timing

FACTORY = {"device": "cpu", "dtype": torch.float32}  # `fuser`: set by fuser(); every tensor and module uses it


def _sync():
    if FACTORY["device"] != "cpu":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ recipe
def recipe(args) -> list:
    """Per-call CPU time of a cached ``str(recipe)`` against rebuilding it (best of --repeat runs, the
    bare loop subtracted). Goal: cached <= 0.15 µs and <= 1/8 of a rebuild."""
    from te_dist import recipe as R

    rows = []
    print(f"{'recipe':<22}{'cached µs':>11}{'rebuild µs':>12}{'ratio':>9}  goal")
    for cls in (R.DelayedScaling, R.Float8CurrentScaling, R.Float8BlockScaling, R.MXFP8BlockScaling,
                R.NVFP4BlockScaling):
        r = cls()
        r.enable_fused_grouped_mlp = True  # an attached attribute, as users do
        names = {"r": r}
        loop, cached = timing.timeit_us(["pass", "str(r)"], names, args.number, args.repeat)
        loop_r, rebuild = timing.timeit_us(["pass", "r._str_cache = None; str(r)"], names, args.number // 10,
                                           args.repeat)
        cached, rebuild = cached - loop, rebuild - loop_r
        met = cached <= 0.15 and cached <= rebuild / 8
        rows.append(dict(recipe=cls.__name__, cached_us=cached, rebuild_us=rebuild, met=met))
        print(f"{cls.__name__:<22}{cached:>11.3f}{rebuild:>12.3f}{rebuild / cached:>8.1f}x  "
              f"{'met' if met else 'MISSED'}")
    return rows


# ------------------------------------------------------------------------------------------ support
SUPPORT_GOAL_US, SUPPORT_GOAL_RATIO, ROUTING_GOAL_US = 0.15, 1 / 8, 1.0


def _empty(recipe, dtype, *, split_alignment=None, device=None):
    """Python's floor: a call with the predicates' signature that does nothing."""
    return True


def support(args) -> list:
    """Per-call CPU time of the grouped-tensor support predicates: uncached (``__wrapped__``), cached with
    the miss's device object, and cached* with an equal but distinct ``torch.device`` (what
    ``tensor.device`` hands out). Explicit device, as every call site passes it; without --real-device a
    fake SM90 capability lookup stands in for the GPU (reached only on misses)."""
    from te_dist import recipe as R
    from te_dist import support as S

    lookup = None
    if not args.real_device:
        lookup = S.set_capability_lookup(lambda d: (9, 0) if d.type == "cuda" else None)
        lookup.__enter__()
    index = torch.cuda.current_device() if args.real_device else 0
    device = torch.device("cuda", index)
    names = {"empty": _empty, "dtype": torch.bfloat16, "device": device, "other_device": torch.device("cuda", index),
             "rec": None, "al": 16}
    call = "{f}(rec, dtype, split_alignment=al, device={d})"
    loop, floor = timing.timeit_us(["pass", call.format(f="empty", d="device")], names, args.calls, args.repeats)
    print(f"# device={device} ({'real' if args.real_device else 'fake SM90 capability'}); best of {args.repeats} x "
          f"{args.calls} calls; load {os.getloadavg()[0]:.2f}; floors: loop {loop:.3f} µs, empty call {floor:.3f} µs")
    print(f"{'predicate':<38}{'recipe':<15}{'uncached':>9}{'cached':>8}{'cached*':>9}{'ratio*':>7}  goals")
    rows = []
    cases = [("None (bf16)", None, 16), ("Float8Current", R.Float8CurrentScaling(), 16),
             ("MXFP8", R.MXFP8BlockScaling(), 32)]
    try:
        for pred in (S.is_module_grouped_tensor_supported, S.is_op_fuser_grouped_tensor_supported):
            for label, rec, al in cases:
                names.update(pred=pred, unc=pred.__wrapped__, rec=rec, al=al)
                pred(rec, torch.bfloat16, split_alignment=al, device=device)  # the one miss
                unc, cac, other = timing.timeit_us(
                    [call.format(f="unc", d="device"), call.format(f="pred", d="device"),
                     call.format(f="pred", d="other_device")], names, args.calls, args.repeats)
                worst = max(cac, other)
                met = worst <= SUPPORT_GOAL_US and worst / unc <= SUPPORT_GOAL_RATIO
                rows.append(dict(predicate=pred.__name__, recipe=label, uncached_us=unc, cached_us=cac,
                                 cached_other_device_us=other, met=met))
                print(f"{pred.__name__:<38}{label:<15}{unc:9.3f}{cac:8.3f}{other:9.3f}{other / unc:7.3f}  "
                      f"{'met' if met else 'NOT met'}")
        rows += routing(args)
    finally:
        if lookup is not None:
            lookup.__exit__(None, None, None)
    return rows


def routing(args) -> list:
    """Host time of one forward's routing decision (``GroupedLinear.native_path``) with a sizes tuple seen
    before (the fused MLP's ask after the layer's) and a new one (a step's first)."""
    from te_dist import recipe as R
    from te_dist import support as S
    from te_dist.ops import GroupedLinear

    pred, rows = S.is_op_fuser_grouped_tensor_supported, []
    print(f"\n{'routing per forward':<38}{'experts':>8}{'seen sizes':>12}{'new sizes':>11}  "
          f"goal <= {ROUTING_GOAL_US} µs")
    calls = args.calls // 10
    for experts in (8, 64):
        for label, rec in (("Float8Block", R.Float8BlockScaling()), ("Float8Current", R.Float8CurrentScaling())):
            op = GroupedLinear(experts, 256, 256)
            op.reset_recipe_state(rec)
            names = dict(op=op, x=torch.empty(experts * 128, 256), sizes=tuple([128] * experts), pred=pred)
            seen = timing.timeit_us(["op.native_path(x, sizes, pred)"], names, calls, args.repeats)[0]
            new = float("inf")
            for _ in range(args.repeats):  # a new tuple per call
                names["fresh"] = iter([tuple([128] * experts) for _ in range(calls)])
                new = min(new, timing.timeit_us(["op.native_path(x, next(fresh), pred)"], names, calls, 1)[0])
            rows.append(dict(predicate="GroupedLinear.native_path", recipe=label, experts=experts, seen_sizes_us=seen,
                             new_sizes_us=new))
            print(f"{'GroupedLinear.native_path ' + label:<38}{experts:>8}{seen:12.3f}{new:11.3f}")
    return rows


# ------------------------------------------------------------------------------------------ fuser
class PlainExpertMLP(torch.nn.Module):
    """The expert MLP as plain torch: per-expert F.linear, SwiGLU, probabilities, per-expert F.linear."""

    def __init__(self, E, H, F):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(E, 2 * F, H, **FACTORY) * H ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, F, **FACTORY) * F ** -0.5)

    def forward(self, x, split_list, probs):
        outs = []
        for e, xe in enumerate(x.split(split_list)):
            gate, up = torch.nn.functional.linear(xe, self.w1[e]).chunk(2, -1)
            outs.append(torch.nn.functional.silu(gate) * up)
        a = torch.cat(outs) * probs[:, None].to(x.dtype)
        return torch.cat([torch.nn.functional.linear(ae, self.w2[e]) for e, ae in enumerate(a.split(split_list))])


def _bench(fn, args, scale=1):
    return timing.cpu_us(fn, args.iters * scale, args.repeats, sync=_sync)


def _fuser_lookup_rows(args, recipe):
    import te_dist
    from te_dist import ops
    from te_dist.autocast import get_active_recipe, get_recipe_key

    fuser = ops.OperationFuser([ops.BasicLinear(16, 16, **FACTORY), ops.Bias(16, **FACTORY), ops.GELU(),
                                ops.BasicLinear(16, 16, **FACTORY)])
    x = torch.randn(4, 16, **FACTORY)
    with te_dist.autocast(recipe=recipe):
        fuser(x)
        key, get_plan, first_op = fuser.fusion_key, fuser.get_plan, fuser.first_op_requiring_backward

        def key_and_lookup():
            r = get_active_recipe()
            return get_plan((get_recipe_key() if r is not None else None, first_op(x, ())), r)

        return [("plan lookup: get_plan(key) hit", _bench(lambda: get_plan(key, recipe), args, 10), None),
                ("recipe key + first_op + get_plan", _bench(key_and_lookup, args, 10), None),
                ("dict.get (floor)", _bench(lambda: fuser._plans.get(key), args, 10), None)]


def _fuser_sequential_rows(args, recipe, H=64, T=8):
    import te_dist
    from te_dist import ops

    torch.manual_seed(0)
    ours = ops.Sequential(ops.BasicLinear(H, H, **FACTORY), ops.Bias(H, **FACTORY), ops.GELU(),
                          ops.BasicLinear(H, H, **FACTORY))
    plain = torch.nn.Sequential(torch.nn.Linear(H, H, **FACTORY), torch.nn.GELU(),
                                torch.nn.Linear(H, H, bias=False, **FACTORY))
    x = torch.randn(T, H, requires_grad=True, **FACTORY)

    def no_grad(model):
        with torch.no_grad():
            return model(x)

    with te_dist.autocast(recipe=recipe):
        t_ours, t_eval = _bench(lambda: ours(x).sum().backward(), args), _bench(lambda: no_grad(ours), args)
    return [("Sequential(Linear,Bias,GELU,Linear) fwd+bwd", t_ours, _bench(lambda: plain(x).sum().backward(), args)),
            ("same, forward under no_grad", t_eval, _bench(lambda: no_grad(plain), args))]


def _fuser_mlp_rows(args, recipe, E=4, H=64, F=64):
    import te_dist
    from te_dist import kernels, ops

    T = args.tokens or (32 if FACTORY["device"] == "cpu" else 64)  # CUDA: > 8 rows per expert (no host sync)
    torch.manual_seed(0)
    fuser = ops.OperationFuser([ops.GroupedLinear(E, H, 2 * F, **FACTORY), ops.ScaledSwiGLU(),
                                ops.GroupedLinear(E, F, H, **FACTORY)])
    plain = PlainExpertMLP(E, H, F)
    dev = FACTORY["device"]
    x = torch.randn(T, H, requires_grad=True, **FACTORY)
    probs = torch.rand(T, requires_grad=True, device=dev)
    split_list = [T // E] * E
    uneven_list = [3 * T // 32, 0, 20 * T // 32, T - 23 * T // 32]  # one expert idle
    splits, uneven = torch.tensor(split_list, device=dev), torch.tensor(uneven_list, device=dev)
    fc1, fc2 = fuser.basic_ops[0], fuser.basic_ops[2]
    w1, w2 = fc1.weight.detach().transpose(1, 2), fc2.weight.detach().transpose(1, 2)
    offsets = torch.cumsum(splits, 0, dtype=torch.int32)
    xd, h = x.detach(), torch.randn(T, 2 * F, **FACTORY)
    s, dy = torch.randn(T, F, **FACTORY), torch.randn(T, H, **FACTORY)

    def gemms():  # the six grouped GEMMs as GroupedLinear calls them (backward operands already validated)
        kernels.grouped_mm_forward(xd, w1, offsets, check_offsets=False)
        kernels.grouped_mm_forward(s, w2, offsets, row_scale_T=probs.detach(), check_offsets=False)
        kernels.grouped_mm_dgrad(dy, w2, offsets, validate=False)
        kernels.grouped_mm_wgrad(s, dy, offsets, num_groups=E, validate=False)
        kernels.grouped_mm_dgrad(h, w1, offsets, validate=False)
        kernels.grouped_mm_wgrad(xd, h, offsets, num_groups=E, validate=False)

    with te_dist.autocast(recipe=recipe):
        t_ours = _bench(lambda: fuser(x, splits, probs, splits).sum().backward(), args)
        t_uneven = _bench(lambda: fuser(x, uneven, probs, uneven).sum().backward(), args)
    assert type(fuser.plan.forward_ops[0].op).__name__ == "GroupedMLP"
    return [(f"grouped MLP fwd+bwd (E={E}, H={H}, F={F}, T={T})", t_ours,
             _bench(lambda: plain(x, split_list, probs).sum().backward(), args)),
            ("  of which: its 6 grouped GEMM calls", _bench(gemms, args), None),
            (f"  same, uneven splits {uneven_list}", t_uneven,
             _bench(lambda: plain(x, uneven_list, probs).sum().backward(), args))]


def fuser(args) -> list:
    """Process CPU time per call (one torch thread, median of --repeats) of the fuser's plan lookup, a 4-op
    Sequential and the grouped expert MLP, against the same computation as plain torch modules. With
    --device cuda: bf16 on the GPU, the CPU time to issue the work. Goals: lookup <= 1 µs, Sequential
    <= 1.5x torch, grouped MLP fwd+bwd <= 300 µs (CPU)."""
    from te_dist.recipe import recipe_from_name

    if args.device != "cpu":
        FACTORY.update(device=args.device, dtype=torch.bfloat16)
    torch.set_num_threads(args.threads)
    rec = recipe_from_name(args.recipe)
    print(f"torch {torch.__version__}, device={args.device}, dtype={FACTORY['dtype']}, threads={args.threads}, "
          f"recipe={args.recipe}, iters={args.iters}, repeats={args.repeats}")
    rows = []
    print(f"{'measurement':<52} {'te_dist µs':>10} {'torch µs':>10} {'ratio':>7}")
    for name, ours, plain in (_fuser_lookup_rows(args, rec) + _fuser_sequential_rows(args, rec)
                              + _fuser_mlp_rows(args, rec)):
        rows.append(dict(measurement=name.strip(), te_dist_us=ours, torch_us=plain,
                         ratio=ours / plain if plain else None))
        print(f"{name:<52} {ours:>10.3f}" + (f" {plain:>10.1f} {ours / plain:>7.2f}" if plain else ""))
    return rows


# ------------------------------------------------------------------------------------------ mlp-host
def mlp_host(args) -> list:
    """Host time to queue one fused expert-MLP forward+backward per recipe against bf16's, on shapes so
    small the GPU never holds the host back (split sizes on the host, multiples of 128: the native path
    with no device read; rounds of the recipes interleaved). Goal: <= 1.5x bf16."""
    import te_dist as td
    from te_dist.moe.expert_mlp import build_expert_mlp
    from te_dist.ops import GroupSplits
    from te_dist.recipe import recipe_from_name

    if not torch.cuda.is_available():
        raise SystemExit("mlp-host needs a CUDA GPU: it measures the host time of queued GPU work")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    mlp = build_expert_mlp(args.experts, args.hidden, args.ffn, dtype=torch.bfloat16, device=dev)
    n = args.experts * args.rows
    x = torch.randn(n, args.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    probs, grad = torch.rand(n, device=dev), torch.randn(n, args.hidden, device=dev, dtype=torch.bfloat16)
    sizes = (args.rows,) * args.experts
    splits = GroupSplits(torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32), sizes)
    names = ["none"] + [r for r in args.recipes.split(",") if r and r != "none"]
    mlps = {name: copy.deepcopy(mlp) for name in names}  # one per recipe: each keeps its quantizer state

    def make_step(name):
        m, rec = mlps[name], recipe_from_name(name)

        def step():
            m.zero_grad(set_to_none=True)
            x.grad = None
            with td.autocast(recipe=rec):
                y = m(x, splits, probs, splits)
            y.backward(grad)
        return step

    steps = {name: make_step(name) for name in names}
    for step in steps.values():  # kernels built, weight copies cast, plans made
        for _ in range(3):
            step()
    times = {name: [] for name in names}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(timing.host_us(step, args.calls, rounds=1, sync=timing.cuda_sync, warmup=0))
    base = timing.median(times["none"])
    print(f"expert MLP fwd+bwd, {args.experts} experts x {args.rows} rows, H {args.hidden}, F {args.ffn}, bf16; host "
          f"µs per step (median of {args.rounds} rounds of {args.calls}); {torch.cuda.get_device_name()}")
    print("| recipe | host µs / step | vs bf16 | path |\n|---|---|---|---|")
    rows = []
    for name in names:
        us = timing.median(times[name])
        path = "-" if name == "none" else ("native" if mlps[name].basic_ops[0].has_native_weight_copy else "emulated")
        rows.append(dict(recipe=name, host_us=us, vs_bf16=us / base, path=path))
        print(f"| {name} | {us:.1f} | {us / base:.2f}x | {path} |")
    return rows


# ------------------------------------------------------------------------------------------ consensus
def consensus_launch(argv) -> int:
    """Re-run this script under torchrun with ``--nproc`` ranks (the workers land in consensus_worker)."""
    args = build_parser().parse_args(argv)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "--max-restarts=0", __file__, *argv]
    return subprocess.call(cmd, env=timing.repo_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def consensus_worker(args) -> list:
    """Per-step cost of recipe consensus in the steady state against the same step without it: a tiny
    data-parallel step (2-layer MLP 64->64 on 16 rows, one gradient all_reduce) under autocast(recipe)
    without a group, with group=world (steady state: one 16-byte digest all_reduce on a gloo side
    group), and forced through the first-time path every step; plus the collectives alone. Interleaved
    rounds, median over rounds, the slower rank."""
    import torch.distributed as dist

    import te_dist as td
    from te_dist.autocast import get_recipe_key
    from te_dist.distributed import consensus
    from te_dist.recipe import recipe_from_name

    timeout = datetime.timedelta(seconds=120)
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    world, group = dist.get_world_size(), dist.group.WORLD
    rec = recipe_from_name(args.recipe)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).to(device)
    x = torch.randn(16, 64, device=device)

    def step(with_group):
        with td.autocast(recipe=rec, group=group if with_group else None):
            get_recipe_key()  # what a fuser reads per call
            loss = model(x).square().mean()
        loss.backward()
        dist.all_reduce(torch.cat([p.grad.flatten() for p in model.parameters()]), group=group)
        model.zero_grad(set_to_none=True)

    state = consensus._REGISTRY.get(group, consensus.DEFAULT_TIMEOUT_S)

    def full_exchange_step():
        state.verified.clear()  # the first-time path: digest all_reduce + string all_gather
        step(True)

    cpu_group, cpu_box = state.cpu_group, torch.tensor([1], dtype=torch.int64)
    counts = torch.arange(world * 8, dtype=torch.int64, device=device)
    counts_plus = torch.arange(world * 9, dtype=torch.int64, device=device)
    out, out_plus = torch.empty_like(counts), torch.empty_like(counts_plus)
    variants = [
        ("step", lambda: step(False)), ("step + consensus", lambda: step(True)),
        ("step + full exchange", full_exchange_step),
        ("sync_recipe (steady)", lambda: consensus.sync_recipe(rec, group)),
        ("8-byte all_reduce (cpu)", lambda: dist.all_reduce(cpu_box, group=cpu_group)),
        ("broadcast_object_list", lambda: dist.broadcast_object_list([str(rec)], src=0, group=cpu_group)),
        ("counts all_to_all", lambda: (dist.all_to_all_single(out, counts, group=group), out.tolist())),
        ("counts+digest all_to_all", lambda: (dist.all_to_all_single(out_plus, counts_plus, group=group),
                                              out_plus.tolist())),
    ]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _, fn in variants:
        for _ in range(args.warmup):
            fn()
    per_round = max(1, args.steps // args.rounds)
    samples = {name: [] for name, _ in variants}
    for _ in range(args.rounds):  # every variant once per round: load drift hits all alike
        for name, fn in variants:
            sync()
            dist.barrier(group=cpu_group)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(per_round):
                fn()
            sync()
            samples[name].append(((time.process_time() - cpu0) / per_round * 1e6,
                                  (time.perf_counter() - wall0) / per_round * 1e6))
    rows = []
    for name, _ in variants:
        both = torch.tensor([timing.median(c for c, _ in samples[name]), timing.median(w for _, w in samples[name])],
                            dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=cpu_group)  # the slowest rank sets the pace
        rows.append(dict(variant=name, cpu_us=float(both[0]), wall_us=float(both[1])))
    if dist.get_rank() == 0:
        base = rows[0]["wall_us"]
        print(f"consensus overhead: backend={args.backend} ranks={world} recipe={args.recipe} steps={args.steps} "
              f"rounds={args.rounds} (median over rounds, max over ranks)")
        print(f"{'variant':28s} {'cpu µs/step':>12s} {'wall µs/step':>13s} {'+wall vs step':>14s}")
        for r in rows:
            extra = f"{r['wall_us'] - base:14.1f}" if r["variant"].startswith("step") else f"{'-':>14s}"
            print(f"{r['variant']:28s} {r['cpu_us']:12.1f} {r['wall_us']:13.1f} {extra}")
    dist.barrier(group=cpu_group)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rows if rank == 0 else []


# ------------------------------------------------------------------------------------------ entry
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("recipe", help=recipe.__doc__.splitlines()[0])
    p.add_argument("--number", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=7)
    p = sub.add_parser("support", help=support.__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--real-device", action="store_true", help="the current CUDA device, not a fake capability")
    p = sub.add_parser("fuser", help=fuser.__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--recipe", default="none", help="none | delayed | current | block | mxfp8 | nvfp4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu (float32) | cuda (bfloat16)")
    p.add_argument("--tokens", type=int, default=None, help="grouped-MLP tokens (default 32 on cpu, 64 on cuda)")
    p = sub.add_parser("mlp-host", help=mlp_host.__doc__.splitlines()[0])
    p.add_argument("--recipes", default="current,delayed,block")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rows", type=int, default=256, help="rows per expert (a multiple of 128)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7)
    p = sub.add_parser("consensus", help=consensus_worker.__doc__.splitlines()[0])
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=600, help="steps per variant, split over --rounds")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--recipe", default="current", help="a name for te_dist.recipe.recipe_from_name")
    timing.add_json_option(*sub.choices.values())
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if build_parser().parse_args(argv).what == "consensus" and "LOCAL_RANK" not in os.environ:
        return consensus_launch(argv)
    return timing.run_subcommand(build_parser(), {"recipe": recipe, "support": support, "fuser": fuser,
                                                  "mlp-host": mlp_host, "consensus": consensus_worker},
                                 "overhead", argv)


if __name__ == "__main__":
    sys.exit(main())
