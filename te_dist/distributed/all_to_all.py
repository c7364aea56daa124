"""Token all-to-all for expert parallelism: a count exchange, then variable-split token moves.

Forward and backward of a token all-to-all are the same collective with the split lists
swapped, so one autograd function serves both dispatch (tokens to their experts' ranks) and
combine (expert outputs back to the tokens' ranks).

    counts_send [ep * E_local]  --all_to_all-->  counts_recv [ep * E_local]
      chunk r = my tokens for rank r's experts     chunk r = rank r's tokens for my experts
    x_send [sum(input_splits), H]  --all_to_all_single(output_splits, input_splits)-->  x_recv

Every rank of the group must enter each collective, also with zero rows to send or receive.
Each wait is bounded by the group's timeout (or ``timeout_s``) and a failure names the operation
(``op``) and the rank (te_dist.distributed.bounded): gloo would otherwise wait forever here.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .bounded import check_timeout_s, wait_collective
from .groups import group_size

__all__ = ["exchange_counts", "all_to_all_tokens", "split_sizes_from_counts"]


def exchange_counts(counts_send: torch.Tensor, group, *, timeout_s: Optional[float] = None) -> torch.Tensor:
    """All-to-all of per-expert token counts; ``counts_send`` is [ep_size * E_local] int64.

    Negative entries are passed through untouched: callers use them as an in-band error flag
    (for example NaN router logits), so every rank learns of one rank's failure from the
    metadata it exchanges anyway, and no rank is left waiting in the token all-to-all.
    """
    if counts_send.dim() != 1 or counts_send.dtype != torch.int64:
        raise TypeError(f"counts must be a 1-D int64 tensor, got shape={tuple(counts_send.shape)} dtype={counts_send.dtype}")
    timeout_s = check_timeout_s(timeout_s)
    ep_size = group_size(group)
    if counts_send.numel() % ep_size != 0:
        raise ValueError(f"counts has {counts_send.numel()} entries, not divisible by {ep_size=}")
    if ep_size == 1:
        return counts_send.clone()
    counts_recv = torch.empty_like(counts_send)
    work = dist.all_to_all_single(counts_recv, counts_send.contiguous(), group=group, async_op=True)
    wait_collective(work, "token count exchange (all_to_all)", group, timeout_s=timeout_s)
    return counts_recv


def split_sizes_from_counts(counts: torch.Tensor, ep_size: int) -> list:
    """Per-rank row counts from per-expert counts laid out [ep_size, E_local] (host list)."""
    return counts.view(ep_size, -1).sum(dim=1).tolist()


def _all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group, op: str,
                timeout_s: Optional[float]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=list(output_splits),
                                  input_split_sizes=list(input_splits), group=group, async_op=True)
    wait_collective(work, op, group, timeout_s=timeout_s)
    return out


class _AllToAllTokens(torch.autograd.Function):
    """Forward: send rows by ``input_splits``, receive by ``output_splits``. Backward: the reverse."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, op, timeout_s):
        ctx.group = group
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        ctx.op, ctx.timeout_s = op, timeout_s
        return _all_to_all(x, output_splits, input_splits, group, op, timeout_s)

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = _all_to_all(grad_out, ctx.input_splits, ctx.output_splits, ctx.group, f"{ctx.op}, backward",
                              ctx.timeout_s)
        return grad_in, None, None, None, None, None


def all_to_all_tokens(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group, *,
                      op: str = "token all-to-all", timeout_s: Optional[float] = None) -> torch.Tensor:
    """Differentiable variable-split all-to-all over dim 0 of ``x`` (identity for a group of one).

    ``input_splits[r]`` rows of ``x`` go to rank r; ``output_splits[r]`` rows arrive from rank r.
    ``op`` names the call in errors; ``timeout_s`` (default: the group's timeout) bounds each wait.
    """
    ep_size = group_size(group)
    output_splits = [int(s) for s in output_splits]
    input_splits = [int(s) for s in input_splits]
    if len(output_splits) != ep_size or len(input_splits) != ep_size:
        raise ValueError(
            f"split lists need one entry per rank ({ep_size=}), got {len(input_splits)=} {len(output_splits)=}"
        )
    if min(output_splits + input_splits, default=0) < 0:
        raise ValueError(f"negative split sizes: {input_splits=} {output_splits=}")
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"input splits sum to {sum(input_splits)} but x has {x.shape[0]} rows")
    timeout_s = check_timeout_s(timeout_s)
    if ep_size == 1:
        return x
    return _AllToAllTokens.apply(x, output_splits, input_splits, group, op, timeout_s)
