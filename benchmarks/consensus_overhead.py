"""Per-step cost of recipe consensus in the steady state, against the same step without it.

Launches itself under torchrun (2 ranks, gloo on CPU by default; ``--backend nccl`` on GPUs) and
prints, per variant, the mean CPU time (this process) and wall time per step over ``--steps``
steps, plus the difference and ratio against the baseline step measured in the same run.

    python benchmarks/consensus_overhead.py                       # 2 ranks, gloo, CPU
    python benchmarks/consensus_overhead.py --backend nccl        # 2 ranks, NCCL, one GPU each

Variants:
  step                     a tiny data-parallel training step (forward, backward, one gradient
                           all_reduce) under autocast(recipe) without a group: the baseline
  step + consensus         the same step under autocast(recipe, group=world): the steady state,
                           one 16-byte digest all_reduce on a CPU (gloo) group
  step + full exchange     the same, but forcing the first-time path every step (digest all_reduce
                           plus an all_gather of the strings): what exchanging strings would cost
  sync_recipe (steady)     the consensus call alone
  8-byte all_reduce (cpu)  one bare gloo all_reduce, the floor of any per-step collective
  broadcast_object_list    rank 0's string broadcast as an object, the naive per-step design
  counts all_to_all        the MoE count exchange (E_local=8) alone, and with a digest appended
                           (the "ride on metadata" alternative)
  gpu digest + .item()     (NCCL only) the digest all_reduced on the GPU and read back: a host sync
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def launch(argv) -> int:
    args = parse(argv)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "--max-restarts=0", __file__, *argv]
    return subprocess.call(cmd, env=env)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=600, help="steps per variant, split over --rounds")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--recipe", default="current", help="recipe name for te_dist.recipe.recipe_from_name")
    return p.parse_args(argv)


def worker(argv) -> None:
    import torch
    import torch.distributed as dist

    import te_dist as td
    from te_dist.autocast import get_recipe_key
    from te_dist.distributed import consensus
    from te_dist.recipe import recipe_from_name

    args = parse(argv)
    if args.backend == "nccl":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=120))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    recipe = recipe_from_name(args.recipe)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).to(device)
    x = torch.randn(16, 64, device=device)

    def sync_device():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(with_group):
        with td.autocast(recipe=recipe, group=group if with_group else None):
            get_recipe_key()  # what a fuser reads per call
            loss = model(x).square().mean()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(grads, group=group)  # data-parallel gradient reduction: ranks already meet once a step
        model.zero_grad(set_to_none=True)

    state = consensus._REGISTRY.get(group, consensus.DEFAULT_TIMEOUT_S)

    def full_exchange_step():
        state.verified.clear()  # forces the first-time path: digest all_reduce + string all_gather
        step(True)

    cpu_box = torch.tensor([1], dtype=torch.int64)
    cpu_group = state.cpu_group
    key = str(recipe)
    counts = torch.arange(world * 8, dtype=torch.int64, device=device)
    counts_plus = torch.arange(world * 9, dtype=torch.int64, device=device)
    counts_out = torch.empty_like(counts)
    counts_plus_out = torch.empty_like(counts_plus)

    variants = [
        ("step", lambda: step(False)),
        ("step + consensus", lambda: step(True)),
        ("step + full exchange", full_exchange_step),
        ("sync_recipe (steady)", lambda: consensus.sync_recipe(recipe, group)),
        ("8-byte all_reduce (cpu)", lambda: dist.all_reduce(cpu_box, group=cpu_group)),
        ("broadcast_object_list", lambda: dist.broadcast_object_list([key], src=0, group=cpu_group)),
        ("counts all_to_all", lambda: (dist.all_to_all_single(counts_out, counts, group=group), counts_out.tolist())),
        ("counts+digest all_to_all",
         lambda: (dist.all_to_all_single(counts_plus_out, counts_plus, group=group), counts_plus_out.tolist())),
    ]
    if device.type == "cuda":
        digest_gpu = torch.tensor([1, -1], dtype=torch.int64, device=device)
        variants.append(("gpu digest + .item()",
                         lambda: (dist.all_reduce(digest_gpu, op=dist.ReduceOp.MAX, group=group), digest_gpu.tolist())))

    # Interleaved rounds: every variant runs once per round, so drift in machine load (2 shared
    # cores here) hits all variants alike; the per-variant figure is the median over rounds.
    for _, fn in variants:
        for _ in range(args.warmup):
            fn()
    per_round = max(1, args.steps // args.rounds)
    samples = {name: [] for name, _ in variants}
    for _ in range(args.rounds):
        for name, fn in variants:
            sync_device()
            dist.barrier(group=cpu_group)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(per_round):
                fn()
            sync_device()
            cpu = (time.process_time() - cpu0) / per_round * 1e6
            wall = (time.perf_counter() - wall0) / per_round * 1e6
            samples[name].append((cpu, wall))
    rows = []
    for name, _ in variants:
        cpu = statistics.median(c for c, _ in samples[name])
        wall = statistics.median(w for _, w in samples[name])
        both = torch.tensor([cpu, wall], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=cpu_group)  # the slowest rank sets the pace
        rows.append((name, float(both[0]), float(both[1])))

    if rank == 0:
        base_cpu, base_wall = rows[0][1], rows[0][2]
        host = f"{torch.cuda.get_device_name(device)}" if device.type == "cuda" else "CPU"
        print(f"consensus overhead: backend={args.backend} ranks={world} device={host} recipe={args.recipe} "
              f"steps={args.steps} rounds={args.rounds} torch={torch.__version__} "
              "(median over rounds, max over ranks)")
        print(f"{'variant':28s} {'cpu us/step':>12s} {'wall us/step':>13s} {'+cpu vs step':>13s} "
              f"{'+wall vs step':>14s} {'wall ratio':>10s}")
        for name, cpu, wall in rows:
            if name.startswith("step"):
                print(f"{name:28s} {cpu:12.1f} {wall:13.1f} {cpu - base_cpu:13.1f} {wall - base_wall:14.1f} "
                      f"{wall / base_wall:10.2f}")
            else:  # a collective measured alone: its absolute cost is the comparison
                print(f"{name:28s} {cpu:12.1f} {wall:13.1f} {'-':>13s} {'-':>14s} {'-':>10s}")
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        worker(sys.argv[1:])
    else:
        sys.exit(launch(sys.argv[1:]))
