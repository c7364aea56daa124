"""torchrun worker: MoELayer at EP=N against MoELayer at EP=1, forward and every gradient.

Every rank holds its own tokens (a slice of one global batch). The EP=1 reference layer is
built on every rank from the same seed and runs the tokens of the whole EP group, so:
  * output rows of this rank          == reference rows of this rank's slice
  * input gradient                    == reference input gradient slice
  * local expert weight/bias grads    == reference grads of those global experts
  * router grad summed over the group == reference router grad (the router is replicated)
  * the EP layer's initial weights    == the reference's (EP-invariant init), bit for bit

Scenarios (argv[1], comma-separated): equivalence, sigmoid, skewed, one_expert, empty,
edp (EP inside a larger world: expert grads reduced over the EDP group), save:<dir>, load:<dir>. ``--ep-sizes`` picks the EP sizes to test inside this world (default:
the world size). ``--backend nccl`` runs on cuda:LOCAL_RANK in bf16.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from worker_env import init_worker

import te_dist as td
from te_dist.distributed import init_expert_parallel_groups
from te_dist.moe import merge_expert_state_dicts

H, F, E, T = 16, 12, 8, 6  # hidden, ffn, experts, tokens per rank
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def close(actual, expected, dtype, what):
    scale = max(float(expected.detach().abs().max()) if expected.numel() else 0.0, 1.0)
    tol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def global_batch(world, device, dtype, tokens_of=None, positive=False):
    """[sum tokens, H] inputs and upstream grads; tokens_of(rank) sets per-rank token counts."""
    counts = [T if tokens_of is None else tokens_of(r) for r in range(world)]
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(sum(counts), H, generator=gen)
    if positive:
        x = x.abs() + 0.1
    g = torch.randn(sum(counts), H, generator=gen)
    starts = [sum(counts[:r]) for r in range(world)]
    return x.to(device, dtype), g.to(device, dtype), counts, starts


def build(seed, group, device, dtype, **kw):
    torch.manual_seed(seed)
    opts = dict(bias=True, dtype=dtype, device=device)
    opts.update(kw)
    top_k = opts.pop("top_k", 2)
    return td.moe.MoELayer(H, F, E, top_k, ep_group=group, **opts)


def force_router(layer, experts):
    """Route every (positive) token to ``experts``: their gate rows dominate."""
    with torch.no_grad():
        layer.router.weight.zero_()
        for i, e in enumerate(experts):
            layer.router.weight[e] = 1.0 + 0.1 * i


def compare(groups, device, dtype, *, layer_kw=None, tokens_of=None, route_to=None, name=""):
    world, rank = dist.get_world_size(), dist.get_rank()
    layer_kw = layer_kw or {}
    ep_layer = build(7, groups.ep_group, device, dtype, **layer_kw)
    ref = build(7, None, device, dtype, **layer_kw)
    # EP-invariant init: bit-identical experts before any forcing
    ref_sd = ref.state_dict()
    for key, value in ep_layer.state_dict().items():
        assert torch.equal(value, ref_sd[key]), f"{name}: init of {key} differs between EP={groups.ep_size} and EP=1"
    if route_to is not None:
        force_router(ep_layer, route_to)
        force_router(ref, route_to)
    x, g, counts, starts = global_batch(world, device, dtype, tokens_of, positive=route_to is not None)
    # reference runs the tokens of this EP group, in rank order
    group_rows = torch.cat([torch.arange(starts[r], starts[r] + counts[r]) for r in groups.ep_ranks]).to(device)
    x_ref = x[group_rows].detach().clone().requires_grad_(True)
    y_ref = ref(x_ref)
    torch.autograd.backward(y_ref, g[group_rows])
    mine = slice(starts[rank], starts[rank] + counts[rank])
    offset = sum(counts[r] for r in groups.ep_ranks if r < rank)
    ref_mine = slice(offset, offset + counts[rank])

    x_mine = x[mine].detach().clone().requires_grad_(True)
    y = ep_layer(x_mine)
    torch.autograd.backward(y, g[mine])
    close(y, y_ref[ref_mine], dtype, f"{name} output")
    close(x_mine.grad, x_ref.grad[ref_mine], dtype, f"{name} input grad")
    router_grad = ep_layer.router.weight.grad.clone()
    dist.all_reduce(router_grad, group=groups.ep_group)
    close(router_grad, ref.router.weight.grad, dtype, f"{name} router grad")
    lo, hi = ep_layer.first_expert, ep_layer.first_expert + ep_layer.num_local_experts
    assert all(p.allreduce is False for p in ep_layer.expert_parameters())
    assert not hasattr(ep_layer.router.weight, "allreduce")
    for ep_op, ref_op, label in ((ep_layer.fc1, ref.fc1, "fc1"), (ep_layer.fc2, ref.fc2, "fc2")):
        close(ep_op.weight.grad, ref_op.weight.grad[lo:hi], dtype, f"{name} {label}.weight grad")
        close(ep_op.bias.grad, ref_op.bias.grad[lo:hi], dtype, f"{name} {label}.bias grad")
    if route_to is not None:
        for i in range(ep_layer.num_local_experts):
            if lo + i not in route_to:
                assert torch.count_nonzero(ep_layer.fc1.weight.grad[i]) == 0, f"{name}: unused expert {lo + i} got grad"
                assert torch.count_nonzero(ep_layer.fc2.bias.grad[i]) == 0, f"{name}: unused expert {lo + i} got grad"
    routed = int(ep_layer.tokens_per_expert.sum())
    received = int(ep_layer.tokens_per_local_expert.sum())
    if route_to is not None and not any(lo <= e < hi for e in route_to):
        assert received == 0, f"{name}: rank {rank} owns none of {route_to} but received {received} rows"
    print(f"rank={rank} ep={groups.ep_size} scenario={name} ok (routed {routed}, received {received} rows) "
          f"transport={ep_layer.dispatcher.transport}")
    return ep_layer


def expert_data_parallel(groups, device, dtype):
    """EP inside a larger data-parallel world: reducing the marked expert grads over the EDP group
    and the rest over the world reproduces EP=1 on the whole world's batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_layer = build(7, groups.ep_group, device, dtype, edp_group=groups.edp_group)
    ref = build(7, None, device, dtype)
    x, g, counts, starts = global_batch(world, device, dtype)
    x_ref = x.detach().clone().requires_grad_(True)
    torch.autograd.backward(ref(x_ref), g)
    mine = slice(starts[rank], starts[rank] + counts[rank])
    x_mine = x[mine].detach().clone().requires_grad_(True)
    y = ep_layer(x_mine)
    torch.autograd.backward(y, g[mine])
    close(y, ref(x[mine]), dtype, "edp output")
    expert_ids = {id(p) for p in ep_layer.parameters() if getattr(p, "allreduce", True) is False}
    assert expert_ids == {id(p) for p in ep_layer.expert_parameters()}
    for p in ep_layer.parameters():
        dist.all_reduce(p.grad, group=groups.edp_group if id(p) in expert_ids else None)
    close(ep_layer.router.weight.grad, ref.router.weight.grad, dtype, "edp router grad")
    lo, hi = ep_layer.first_expert, ep_layer.first_expert + ep_layer.num_local_experts
    for ep_op, ref_op, label in ((ep_layer.fc1, ref.fc1, "fc1"), (ep_layer.fc2, ref.fc2, "fc2")):
        close(ep_op.weight.grad, ref_op.weight.grad[lo:hi], dtype, f"edp {label}.weight grad")
        close(ep_op.bias.grad, ref_op.bias.grad[lo:hi], dtype, f"edp {label}.bias grad")
    print(f"rank={rank} ep={groups.ep_size} scenario=edp ok (edp ranks {list(groups.edp_ranks)})")


def run_scenario(scenario, args, device, dtype):
    world, rank = dist.get_world_size(), dist.get_rank()
    if scenario.startswith(("save:", "load:")):
        return checkpoint(scenario, device, dtype)
    for ep_size in args.ep_sizes or [world]:
        groups = init_expert_parallel_groups(ep_size, backend=args.backend)
        block = rank // ep_size * ep_size
        assert groups.ep_ranks == tuple(range(block, block + ep_size)), groups
        assert groups.edp_ranks == tuple(range(rank % ep_size, world, ep_size)), groups
        tag = f"{scenario}"
        if scenario == "equivalence":
            compare(groups, device, dtype, name=tag)
            compare(groups, device, dtype, layer_kw=dict(probs_position="combine"), name=tag + "-combine")
        elif scenario == "sigmoid":
            compare(groups, device, dtype, layer_kw=dict(score_function="sigmoid", expert_bias=True), name=tag)
        elif scenario == "skewed":
            # experts 0 and 1 live on EP rank 0 for every EP size <= 4 with E=8: the rest get nothing
            compare(groups, device, dtype, route_to=(0, 1), name=tag)
        elif scenario == "one_expert":
            compare(groups, device, dtype, layer_kw=dict(top_k=1), route_to=(E - 1,), name=tag)
        elif scenario == "edp":
            expert_data_parallel(groups, device, dtype)
        elif scenario == "empty":
            compare(groups, device, dtype, tokens_of=lambda r: 0 if r == 1 else T, name=tag)
        else:
            raise ValueError(f"unknown scenario {scenario!r}")


def checkpoint(scenario, device, dtype):
    """save:<dir> at EP=world writes each rank's experts and outputs; load:<dir> checks them."""
    world, rank = dist.get_world_size(), dist.get_rank()
    action, directory = scenario.split(":", 1)
    directory = Path(directory)
    groups = init_expert_parallel_groups(world)
    x, _, counts, starts = global_batch(4, device, dtype)  # a fixed 4*T-token batch for every world size
    rows_per_rank = x.shape[0] // world
    mine = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
    if action == "save":
        layer = build(11, groups.ep_group, device, dtype)
        with torch.no_grad():
            y = layer(x[mine])
        torch.save({"state": layer.state_dict(), "rows": (mine.start, mine.stop), "y": y.cpu()}, directory / f"rank{rank}.pt")
        dist.barrier()  # a later load: in the same launch must see every rank's file
        print(f"rank={rank} saved {len(layer.state_dict())} entries at EP={world}")
        return
    files = sorted(directory.glob("rank*.pt"))
    saved = [torch.load(f, weights_only=True) for f in files]
    full_sd = merge_expert_state_dicts(s["state"] for s in saved)
    y_saved = torch.cat([s["y"] for s in sorted(saved, key=lambda s: s["rows"][0])]).to(device)
    for ep_group, label in ((groups.ep_group, f"EP={world}"), (None, "EP=1")):
        layer = build(99, ep_group, device, dtype)  # another seed: values must come from the file
        layer.load_state_dict(full_sd)
        rows = mine if ep_group is not None else slice(0, x.shape[0])
        with torch.no_grad():
            y = layer(x[rows])
        close(y, y_saved[rows], dtype, f"checkpoint from EP={len(files)} loaded at {label}")
        print(f"rank={rank} loaded EP={len(files)} checkpoint at {label} ok")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--ep-sizes", type=lambda s: [int(v) for v in s.split(",")], default=None)
    args = parser.parse_args()
    device, dtype = init_worker(args.backend, cpu_dtype=torch.float32, gpu_dtype=torch.bfloat16)
    try:
        for scenario in args.scenarios.split(","):
            run_scenario(scenario, args, device, dtype)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
