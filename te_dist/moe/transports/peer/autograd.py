"""The dispatch and combine of the peer-rows transport, as autograd functions over the senders' regions.

Why one function per direction: the rows live in a shared region between two moves (the sender's
packed rows until the receivers pulled them; the expert outputs pushed home until the sender summed
them; the same for the gradients), and the next move, of this or any other MoE layer, overwrites
them. So each function packs *and* moves, or moves *and* sums, and no tensor that views a region
ever leaves it (te_dist.moe.transports.peer.rows has the transport; docs/moe.md "Peer rows").

    peer_dispatch(x_TH, probs_S, perm)   count exchange | expand gather into the own region | pull
                                         -> x_NH, probs_N (rows by local expert, source rank)
      backward                           push the row gradients | K-sum from the own region
    peer_combine(y_NH, plan, perm)       push expert outputs home | K-sum from the own region -> y_TH
      backward                           expand gather of the gradient into the own region | pull

With probabilities applied at combine, ``peer_combine(sum_rows=False)`` returns the rows [S, H]
(copied out) for :func:`unpermute_tokens` to weight.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .rows import PeerWorkspace, RowPlan, begin_exchange, finish_exchange, pull, push
from ...payload import PROB_BYTES, payload_columns, prob_view
from ...permutation import PermutationState, gather_sum

__all__ = ["peer_dispatch", "peer_combine"]


class _PeerDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, probs_S, perm: PermutationState, ws: PeerWorkspace, counts_E, plans: List[RowPlan]):
        H, dtype, S = x_TH.shape[1], x_TH.dtype, perm.token_S.numel()
        cols = H if probs_S is None else payload_columns(H, dtype)
        plan = begin_exchange(ws, counts_E, cols * dtype.itemsize)
        # The packing runs on the device while the host waits for the count matrix.
        region = ws.region(S, cols, dtype)
        rows = region if region is not None else x_TH.new_empty(S, cols)
        torch.index_select(x_TH, 0, perm.token_S, out=rows[:, :H] if cols != H else rows)
        if probs_S is not None:
            prob_view(rows, H, probs_S.dtype).copy_(probs_S)
        finish_exchange(plan, staged=None if region is not None else rows)
        # The GPU idles from here to the pull's launch: only the pull's own host work comes first.
        x_NH = tail = None
        if not plan.invalid:  # else nothing moves; the dispatcher raises on every rank
            x_NH = x_TH.new_empty(plan.num_received, H)
            tail = None if probs_S is None else x_TH.new_empty(plan.num_received, cols - H)
            pull(plan, [x_NH] if tail is None else [x_NH, tail], barrier_before=False)
        plan.read_counts()  # the matrix's host copy, read while the rows move (the next exchange overwrites it)
        plans.append(plan)
        ctx.plan, ctx.perm, ctx.hidden, ctx.cols, ctx.dtype = plan, perm, H, cols, dtype
        ctx.probs_dtype = None if probs_S is None else probs_S.dtype
        if plan.invalid:
            return x_TH.new_empty(0, H), None if probs_S is None else probs_S.new_empty(0)
        return x_NH, None if tail is None else prob_view(tail, 0, probs_S.dtype).clone()

    @staticmethod
    def backward(ctx, grad_x_NH, grad_probs_N):
        plan, perm, H, cols = ctx.plan, ctx.perm, ctx.hidden, ctx.cols
        ws, N, S = plan.workspace, plan.num_received, plan.num_sent
        dtype = ctx.dtype
        if grad_x_NH is None:
            grad_x_NH = torch.zeros(N, H, dtype=dtype, device=ws.device)
        blocks = [grad_x_NH.to(dtype).contiguous()]
        if ctx.probs_dtype is not None:
            tail = torch.zeros(N, cols - H, dtype=dtype, device=ws.device)
            if grad_probs_N is not None:
                prob_view(tail, 0, ctx.probs_dtype).copy_(grad_probs_N)
            blocks.append(tail)
        push(plan, blocks)
        region = ws.region(S, cols, dtype)
        grad_x = gather_sum(region[:, :H], perm.inverse_S, perm.top_k) if ctx.needs_input_grad[0] else None
        grad_probs = prob_view(region, H, ctx.probs_dtype).clone() if ctx.needs_input_grad[1] else None
        return grad_x, grad_probs, None, None, None, None


def peer_dispatch(ws: PeerWorkspace, x_TH: torch.Tensor, probs_S: Optional[torch.Tensor], perm: PermutationState,
                  counts_E: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor], RowPlan]:
    """``(x_NH, probs_N or None, plan)``: this rank's received rows grouped by (local expert, source
    rank), and their probabilities where ``probs_S`` (permuted row order) rides along. ``counts_E``
    is what this rank sends per global expert (negative: the in-band error flag, then nothing moves
    and ``plan.invalid`` is set on every rank). Differentiable in ``x_TH`` and ``probs_S``."""
    if probs_S is not None and probs_S.dtype.itemsize > PROB_BYTES:
        raise ValueError(f"probabilities of {probs_S.dtype} do not fit the {PROB_BYTES}-byte row tail")
    plans: List[RowPlan] = []
    x_NH, probs_N = _PeerDispatch.apply(x_TH, probs_S, perm, ws, counts_E, plans)
    return x_NH, probs_N, plans[0]


class _PeerCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_NH, plan: RowPlan, perm: PermutationState, sum_rows: bool):
        ws, S, H = plan.workspace, plan.num_sent, y_NH.shape[1]
        if y_NH.shape[0] != plan.num_received:
            raise ValueError(f"expected {plan.num_received} expert output rows, got {y_NH.shape[0]}")
        region = ws.region(S, H, y_NH.dtype)
        if region is None or (H * y_NH.element_size()) % 16 != 0:
            raise ValueError(f"expert output rows [{S}, {H}] of {y_NH.dtype} do not fit the peer rows region "
                             f"({ws.rows_bytes} bytes, rows of a multiple of 16 bytes)")
        push(plan, [y_NH.contiguous()])
        ctx.plan, ctx.perm, ctx.sum_rows, ctx.shape, ctx.dtype = plan, perm, sum_rows, y_NH.shape, y_NH.dtype
        return gather_sum(region, perm.inverse_S, perm.top_k) if sum_rows else region.clone()

    @staticmethod
    def backward(ctx, grad):
        plan, perm = ctx.plan, ctx.perm
        ws = plan.workspace
        region = ws.region(plan.num_sent, ctx.shape[1], ctx.dtype)
        if ctx.sum_rows:
            torch.index_select(grad.to(ctx.dtype), 0, perm.token_S, out=region)
        else:
            region.copy_(grad)
        grad_NH = torch.empty(ctx.shape, dtype=ctx.dtype, device=ws.device)
        pull(plan, [grad_NH])
        return grad_NH, None, None, None


def peer_combine(y_NH: torch.Tensor, plan: RowPlan, perm: PermutationState, sum_rows: bool = True) -> torch.Tensor:
    """Expert outputs home: ``[T, H]`` with each token's K rows summed (fp32 accumulation) when
    ``sum_rows``, else ``[S, H]`` in the sender's permuted row order. Differentiable in ``y_NH``."""
    return _PeerCombine.apply(y_NH, plan, perm, sum_rows)
