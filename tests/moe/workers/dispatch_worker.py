"""torchrun worker: the token dispatcher (``--transport``, default auto) with stand-in experts (no MLP), every EP rank.

Stand-in expert g multiplies its rows by (g + 1), so the combined output has a closed form
``out_t = sum_k w_tk * (e_tk + 1) * x_t`` that each rank checks locally, forward and backward.

Scenarios (argv[1], comma-separated): random, skewed (every token to rank 0's experts, so other
ranks receive nothing), empty (rank 1 has zero tokens), nan (rank 1's routing is invalid: every
rank must raise RoutingError, none may hang), grow (rank 1 sends 60,000 rows: with peer rows, after
the earlier scenarios sized the regions, every rank's region grows while rank 0's rows, packed into
its old region, must survive and rank 1's, packed outside, are copied in). ``--backend nccl`` runs on cuda:LOCAL_RANK; there the
transport is what ``--transport`` (or TE_DIST_EP_TRANSPORT) picks: peer memory or NCCL all-to-all, printed per scenario.
Ranks hold 5 + rank tokens, so in "skewed" (rank 0) and "empty" (rank 1) a rank receives more rows
than R x its own: the dispatcher's pre-built sort index is too short there and it builds the exact one.
"""

import argparse

import torch
import torch.distributed as dist
from worker_env import init_worker

from te_dist.moe import RoutingError, TransportSelector
from te_dist.moe.padding import needs_padding, padded_sizes, total_alignment


def stand_in_experts(x_NH, split_sizes_El, first_expert):
    scale = torch.repeat_interleave(
        torch.arange(split_sizes_El.numel(), device=x_NH.device, dtype=x_NH.dtype) + first_expert + 1,
        split_sizes_El.to(x_NH.device),
        output_size=x_NH.shape[0],
    )
    return x_NH * scale[:, None]


def routing(scenario, rank, E, K, H, device, dtype):
    gen = torch.Generator().manual_seed(100 + rank)
    T = 0 if (scenario == "empty" and rank == 1) else 30000 if (scenario == "grow" and rank == 1) else 5 + rank
    x = torch.randn(T, H, generator=gen).to(device, dtype).requires_grad_(True)
    probs = torch.rand(T, K, generator=gen).to(device, dtype).requires_grad_(True)
    if scenario == "skewed":
        # only rank 0's experts (or the first K experts when rank 0 owns fewer than K)
        pool = max(K, E // dist.get_world_size())
        choices = torch.stack([torch.randperm(pool, generator=gen)[:K] for _ in range(T)])
    else:
        choices = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    return x, probs, choices.to(device, torch.int64).reshape(T, K)


def run(scenario, args, device, dtype):
    rank = dist.get_rank()
    E, K = args.num_experts, 2
    dispatcher = TransportSelector(E, dist.group.WORLD, transport=args.transport)
    x, probs, indices = routing(scenario, rank, E, K, args.hidden, device, dtype)
    transports = set()
    invalid = torch.tensor(scenario == "nan" and rank == 1, device=device)
    try:
        for probs_in_expert, alignment in ((True, None), (False, None), (True, 8), (False, 8)):
            x_NH, splits, probs_N, state = dispatcher.dispatch(x, probs, indices, probs_in_expert=probs_in_expert,
                                                               invalid=invalid, row_alignment=alignment)
            transports.add(state.transport)
            assert dispatcher.transport == state.transport
            assert splits.numel() == dispatcher.num_local_experts
            # The host sizes and the device offsets of the received rows agree with the split sizes.
            assert state.local_expert_sizes == splits.tolist()
            assert state.local_expert_offsets.dtype == torch.int32 and state.local_expert_offsets.device == x.device
            assert state.local_expert_offsets.tolist() == splits.cumsum(0).tolist()
            handed = state.group_splits()  # the split of x_NH: padded where this transport folds the padding
            folds = alignment is not None and state.transport != "peer" and (
                dist.get_world_size() == 1 or dispatcher.num_local_experts > 1)
            pads = folds and needs_padding(splits.tolist(), alignment)
            expected = list(padded_sizes(splits.tolist(), alignment, total_alignment(alignment)) if pads
                            else splits.tolist())
            assert list(handed.sizes) == expected, (handed.sizes, expected)
            assert handed.offsets.tolist() == torch.tensor(expected).cumsum(0).tolist()
            assert x_NH.shape[0] == sum(expected)
            is_pad = torch.cat([torch.arange(p) >= s for s, p in zip(splits.tolist(), expected)]).to(device)
            assert not x_NH[is_pad].any(), "padding rows must be zero"
            if probs_in_expert:
                assert not probs_N[is_pad].any(), "padding rows' probabilities must be zero"
            y_NH = stand_in_experts(x_NH, torch.tensor(expected, device=device), dispatcher.first_expert)
            if not probs_in_expert:
                y_NH = y_NH + is_pad[:, None].to(dtype)  # padding outputs are dropped, whatever they hold
            else:
                y_NH = y_NH * probs_N[:, None]
            out = dispatcher.combine(y_NH, state)
            g_y, = torch.autograd.grad(out, y_NH, torch.ones_like(out), retain_graph=True)
            assert not g_y[is_pad].any(), "padding rows must get zero gradient"
            ref_x = x.detach().clone().requires_grad_(True)
            ref_p = probs.detach().clone().requires_grad_(True)
            ref = ((ref_p * (indices + 1).to(dtype)).sum(-1, keepdim=True)) * ref_x
            torch.testing.assert_close(out, ref)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(device, dtype)
            gx, gp = torch.autograd.grad(out, (x, probs), g)
            rx, rp = torch.autograd.grad(ref, (ref_x, ref_p), g)
            torch.testing.assert_close(gx, rx)
            torch.testing.assert_close(gp, rp)
            if scenario == "skewed" and dispatcher.first_expert >= max(K, dispatcher.num_local_experts):
                assert x_NH.shape[0] == 0, f"rank {rank} should receive nothing, got {x_NH.shape[0]} rows"
    except RoutingError as err:
        if scenario != "nan":
            raise
        print(f"rank={rank} scenario=nan raised RoutingError: {err}")
        return
    assert scenario != "nan", "NaN routing on rank 1 was not detected"
    print(f"rank={rank} scenario={scenario} ok transport={','.join(sorted(transports))}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=3)
    parser.add_argument("--transport", default="auto", choices=("auto", "all_to_all", "peer"))
    args = parser.parse_args()
    device, dtype = init_worker(args.backend, cpu_dtype=torch.float64, gpu_dtype=torch.float32)
    try:
        for scenario in args.scenarios.split(","):
            run(scenario, args, device, dtype)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
