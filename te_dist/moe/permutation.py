"""Token permutation: sort the T*K (token, choice) rows by global expert, and undo it.

Legend: T tokens, K top-k, S = T*K routed rows, H hidden, E experts, R ranks, El local experts.

    x_TH --permute_tokens(indices_TK)--> x_SH  rows grouped by expert 0..E-1 (stable: within an
                                                expert, token order then choice order)
    y_SH --unpermute_tokens(probs?)-----> y_TH  y_T = sum_k probs_TK * y_S[row of (t, k)]

The backward of each step is a pure row scatter/gather with unique indices plus a fixed-order
sum over K, never an atomic ``index_add``: gradients are bitwise deterministic on GPU.

After the dispatch all-to-all, rows arrive grouped by (source rank, local expert); the grouped
GEMM needs them grouped by (local expert, source rank). ``chunk_sort_index`` builds that row
permutation from the received count matrix [R, El], on the counts' device (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "PermutationState",
    "permute_tokens",
    "expert_counts_from_sorted",
    "permute_probs",
    "unpermute_tokens",
    "permute_rows",
    "unpermute_rows",
    "chunk_sort_index",
]


class _PermuteRows(torch.autograd.Function):
    """``scatter=False``: out = x[idx]; ``scatter=True``: out[idx] = x. ``idx`` is a permutation."""

    @staticmethod
    def forward(ctx, x, idx, scatter):
        ctx.save_for_backward(idx)
        ctx.scatter = scatter
        return _scatter(x, idx) if scatter else x.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad_out):
        (idx,) = ctx.saved_tensors
        grad = grad_out.index_select(0, idx) if ctx.scatter else _scatter(grad_out, idx)
        return grad, None, None


def _scatter(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x).index_copy_(0, idx, x)


def permute_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for a row permutation ``idx``; backward scatters (no accumulation needed)."""
    return _PermuteRows.apply(x, idx, False)


def unpermute_rows(y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_rows`: ``out[idx] = y``."""
    return _PermuteRows.apply(y, idx, True)


class _ExpandGather(torch.autograd.Function):
    """out[i] = x[sort_idx[i] // K]: each token copied once per chosen expert.

    Backward scatters the S row gradients back to (t, k) slots and sums over K in order.
    """

    @staticmethod
    def forward(ctx, x_TH, sort_idx_S, top_k):
        ctx.save_for_backward(sort_idx_S)
        ctx.top_k = top_k
        ctx.num_tokens = x_TH.shape[0]
        return x_TH.index_select(0, torch.div(sort_idx_S, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_SH):
        (sort_idx_S,) = ctx.saved_tensors
        grad_flat = _scatter(grad_SH, sort_idx_S)
        grad_TH = grad_flat.view(ctx.num_tokens, ctx.top_k, *grad_SH.shape[1:]).sum(dim=1)
        return grad_TH, None, None


@dataclass
class PermutationState:
    """What :func:`unpermute_tokens` needs to restore token order."""

    sort_idx_S: torch.Tensor  # row i of the permuted tensor is flat (t, k) slot sort_idx_S[i]
    counts_E: torch.Tensor  # int64 [E] rows per global expert, on the indices' device
    num_tokens: int
    top_k: int


def expert_counts_from_sorted(sorted_S: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E] rows per expert from sorted expert ids, on their device.

    ``torch.bincount`` would read its maximum back to the host (a sync per step on GPU);
    boundaries found by ``searchsorted`` need none and are exact.
    """
    bounds = torch.arange(num_experts + 1, device=sorted_S.device, dtype=sorted_S.dtype)
    return torch.diff(torch.searchsorted(sorted_S, bounds)).to(torch.int64)


def permute_tokens(x_TH: torch.Tensor, indices_TK: torch.Tensor, num_experts: int):
    """Sort token copies by global expert. Returns ``(x_SH, state)``.

    ``indices_TK`` int64 global expert ids in ``[0, num_experts)``.
    """
    if x_TH.dim() != 2 or indices_TK.dim() != 2 or x_TH.shape[0] != indices_TK.shape[0]:
        raise ValueError(f"expected x [T, H] and indices [T, K], got {tuple(x_TH.shape)} and {tuple(indices_TK.shape)}")
    num_tokens, top_k = indices_TK.shape
    flat_S = indices_TK.reshape(-1)
    sorted_S, sort_idx_S = torch.sort(flat_S, stable=True)
    counts_E = expert_counts_from_sorted(sorted_S, num_experts)
    x_SH = _ExpandGather.apply(x_TH, sort_idx_S, top_k)
    return x_SH, PermutationState(sort_idx_S, counts_E, num_tokens, top_k)


def permute_probs(probs_TK: torch.Tensor, state: PermutationState) -> torch.Tensor:
    """Routing probabilities in permuted row order [S] (differentiable)."""
    return permute_rows(probs_TK.reshape(-1), state.sort_idx_S)


def unpermute_tokens(y_SH: torch.Tensor, state: PermutationState, probs_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Restore token order and sum each token's K expert outputs (weighted by ``probs_TK`` if given).

    The K-sum accumulates in (at least) fp32 and returns ``y_SH.dtype``.
    """
    y_flat = unpermute_rows(y_SH, state.sort_idx_S)
    y_TKH = y_flat.view(state.num_tokens, state.top_k, *y_SH.shape[1:])
    acc_dtype = torch.promote_types(y_SH.dtype, torch.float32)
    if probs_TK is not None:
        y_TKH = y_TKH.to(acc_dtype) * probs_TK.to(acc_dtype).unsqueeze(-1)
    return y_TKH.sum(dim=1, dtype=acc_dtype).to(y_SH.dtype)


def chunk_sort_index(counts_RL: torch.Tensor, total: int) -> torch.Tensor:
    """Row permutation taking rows grouped [rank][local expert] to [local expert][rank].

    ``counts_RL`` int64 [R, El] (row counts of each chunk, in arrival order); ``total`` its sum
    (passed in so no device-to-host read happens here). ``x_by_expert = x[index]``.
    """
    num_ranks, num_local = counts_RL.shape
    flat = counts_RL.reshape(-1)
    starts_src = torch.cumsum(flat, 0) - flat  # start of chunk (r, e) in arrival order
    lengths = counts_RL.t().reshape(-1)  # target order: (e, r)
    starts = starts_src.view(num_ranks, num_local).t().reshape(-1)
    dst_starts = torch.cumsum(lengths, 0) - lengths
    base = torch.repeat_interleave(starts - dst_starts, lengths, output_size=total)
    return base + torch.arange(total, device=counts_RL.device, dtype=counts_RL.dtype)
