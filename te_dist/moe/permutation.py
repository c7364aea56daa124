"""Token permutation: sort the T*K (token, choice) rows by global expert, and undo it.

Legend: T tokens, K top-k, S = T*K routed rows, H hidden, E experts, R ranks, El local experts.

    x_TH --permute_tokens(indices_TK)--> x_SH  rows grouped by expert 0..E-1 (stable: within an
                                                expert, token order then choice order)
    y_SH --unpermute_tokens(probs?)-----> y_TH  y_T = sum_k probs_TK * y_S[row of (t, k)]

Every step, forward and backward, is a row *gather* (scatters go through the inverse
permutation, computed once per step) plus a fixed-order sum over K, never an atomic
``index_add``: gradients are bitwise deterministic on GPU, and gathers are vectorised.

A permutation may carry padding rows (``PermutationState.pad_rows``, te_dist.moe.padding): the
permuted tensor then has more rows than routed slots, and every gather that writes the permuted
side zeroes them, forward (rows, probabilities) and backward (the gradients of expert outputs).

After the dispatch all-to-all, rows arrive grouped by (source rank, local expert); the grouped
GEMM needs them grouped by (local expert, source rank). ``chunk_sort_index`` builds that row
permutation (``chunk_unsort_index`` its inverse) from the received count matrix [R, El], on the
counts' device (no host sync), for any upper bound of the row count, so the dispatcher queues it
before it reads the counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..ops import RowGather

__all__ = [
    "PermutationState",
    "sort_by_expert",
    "permute_tokens",
    "expand_tokens",
    "expand_rows",
    "expert_counts_from_sorted",
    "permute_probs",
    "unpermute_tokens",
    "permute_rows",
    "unpermute_rows",
    "inverse_permutation",
    "gather_sum",
    "chunk_sort_index",
    "chunk_unsort_index",
]


def _zero_rows(t: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """``t`` with ``rows`` zeroed in place (padding rows; None: none)."""
    return t if rows is None else t.index_fill_(0, rows, 0)


class _PermuteRows(torch.autograd.Function):
    """``out = x[gather_idx]``; backward ``grad_x = grad_out[scatter_idx]``.

    ``scatter_idx`` is the inverse permutation of ``gather_idx``, so both directions are
    gathers: a row gather is vectorised on GPU, an ``index_copy_`` scatter of the same rows moves
    elements one by one (docs/moe.md). ``zero_out`` / ``zero_grad``: padding rows of
    the output (the gather writes the padded side) or of x's gradient (x is the padded side).
    """

    @staticmethod
    def forward(ctx, x, gather_idx, scatter_idx, zero_out=None, zero_grad=None):
        ctx.save_for_backward(scatter_idx, zero_grad)
        return _zero_rows(x.index_select(0, gather_idx), zero_out)

    @staticmethod
    def backward(ctx, grad_out):
        scatter_idx, zero_grad = ctx.saved_tensors
        return _zero_rows(grad_out.index_select(0, scatter_idx), zero_grad), None, None, None, None


def inverse_permutation(idx: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[idx[i]] = i`` (one scatter of int64 indices, no host sync)."""
    return torch.empty_like(idx).scatter_(0, idx, torch.arange(idx.numel(), device=idx.device, dtype=idx.dtype))


def permute_rows(x: torch.Tensor, idx: torch.Tensor, inverse: Optional[torch.Tensor] = None,
                 pad_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x[idx]`` for a row permutation ``idx`` (``inverse``: its inverse, if already known);
    ``pad_rows``: rows of the result that are padding (zeroed; ``inverse`` is then required)."""
    return _PermuteRows.apply(x, idx, inverse_permutation(idx) if inverse is None else inverse, pad_rows)


def unpermute_rows(y: torch.Tensor, idx: torch.Tensor, inverse: Optional[torch.Tensor] = None,
                   pad_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`permute_rows`: ``out[idx] = y``, computed as the gather ``y[inverse]``
    (``pad_rows``: padding rows of ``y``, dropped; their gradient is zero)."""
    return _PermuteRows.apply(y, inverse_permutation(idx) if inverse is None else inverse, idx, None, pad_rows)


def _gather_sum_kernel(y_SH: torch.Tensor, inverse_S: torch.Tensor, top_k: int) -> torch.Tensor:
    """``out[t] = sum_k y[inverse[t*K + k]]`` accumulated in fp32 (at least), in y's dtype.

    Pure tensor code, written as K row gathers added in order (K is static) so that, compiled on
    CUDA, it becomes one pointwise pass with K coalesced row loads per output row. Written as a
    gather followed by a sum over a [T, K, H] view, Inductor emits a reduction far below memory
    bandwidth (docs/moe.md has the figures)."""
    acc = torch.promote_types(y_SH.dtype, torch.float32)
    rows_TK = inverse_S.view(-1, top_k)
    out = y_SH.index_select(0, rows_TK[:, 0]).to(acc)
    for k in range(1, top_k):
        out = out + y_SH.index_select(0, rows_TK[:, k]).to(acc)
    return out.to(y_SH.dtype)


def _fused(fn, x, *args):
    """Run a pure gather/reduce function compiled on CUDA (one kernel), eagerly elsewhere."""
    from ..quantization.compile import dispatch

    return dispatch(fn, x, *args)


def gather_sum(y_SH: torch.Tensor, inverse_S: torch.Tensor, top_k: int) -> torch.Tensor:
    """Restore token order and sum each token's K rows, without autograd (see :class:`_GatherSum`)."""
    if top_k == 1:
        return y_SH.index_select(0, inverse_S)
    return _fused(_gather_sum_kernel, y_SH, inverse_S, top_k)


class _ExpandGather(torch.autograd.Function):
    """out[i] = x[token_S[i]] (token_S = sort_idx // K): each token copied once per chosen expert.

    Backward gathers each token's K row gradients (through the inverse permutation) and sums
    them in a fixed order: deterministic, and one pass when compiled.
    """

    @staticmethod
    def forward(ctx, x_TH, token_S, inverse_S, top_k, pad_rows=None):
        ctx.save_for_backward(inverse_S)
        ctx.top_k = top_k
        return _zero_rows(x_TH.index_select(0, token_S), pad_rows)

    @staticmethod
    def backward(ctx, grad_SH):
        (inverse_S,) = ctx.saved_tensors
        return gather_sum(grad_SH, inverse_S, ctx.top_k), None, None, None, None


class _GatherSum(torch.autograd.Function):
    """Combine without probabilities: out[t] = sum_k y[row of (t, k)]; backward = expand gather."""

    @staticmethod
    def forward(ctx, y_SH, token_S, inverse_S, top_k, pad_rows=None):
        ctx.save_for_backward(token_S, pad_rows)
        return gather_sum(y_SH, inverse_S, top_k)

    @staticmethod
    def backward(ctx, grad_TH):
        token_S, pad_rows = ctx.saved_tensors
        return _zero_rows(grad_TH.index_select(0, token_S), pad_rows), None, None, None, None


@dataclass
class PermutationState:
    """What :func:`unpermute_tokens` needs to restore token order."""

    sort_idx_S: torch.Tensor  # row i of the permuted tensor is flat (t, k) slot sort_idx_S[i]
    counts_E: torch.Tensor  # int64 [E] rows per global expert, on the indices' device
    num_tokens: int
    top_k: int
    inverse_S: Optional[torch.Tensor] = None  # flat slot j sits at permuted row inverse_S[j]
    token_S: Optional[torch.Tensor] = None  # permuted row i is a copy of token token_S[i] (sort_idx_S // K)
    pad_rows: Optional[torch.Tensor] = None  # permuted rows that are padding (zero), when padded


def expert_counts_from_sorted(sorted_S: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E] rows per expert from sorted expert ids, on their device.

    ``torch.bincount`` would read its maximum back to the host (a sync per step on GPU);
    boundaries found by ``searchsorted`` need none and are exact.
    """
    bounds = torch.arange(num_experts + 1, device=sorted_S.device, dtype=sorted_S.dtype)
    return torch.diff(torch.searchsorted(sorted_S, bounds)).to(torch.int64)


def sort_by_expert(x_TH: torch.Tensor, indices_TK: torch.Tensor, num_experts: int) -> PermutationState:
    """The permutation of :func:`permute_tokens` without moving any rows (for callers that gather
    the rows themselves, like the dispatcher's packed payload, te_dist.moe.payload)."""
    if x_TH.dim() != 2 or indices_TK.dim() != 2 or x_TH.shape[0] != indices_TK.shape[0]:
        raise ValueError(f"expected x [T, H] and indices [T, K], got {tuple(x_TH.shape)} and {tuple(indices_TK.shape)}")
    num_tokens, top_k = indices_TK.shape
    flat_S = indices_TK.reshape(-1)
    sorted_S, sort_idx_S = torch.sort(flat_S, stable=True)
    counts_E = expert_counts_from_sorted(sorted_S, num_experts)
    inverse_S = inverse_permutation(sort_idx_S)
    token_S = torch.div(sort_idx_S, top_k, rounding_mode="floor")  # once: the combine's backward gathers by it too
    return PermutationState(sort_idx_S, counts_E, num_tokens, top_k, inverse_S, token_S)


def permute_tokens(x_TH: torch.Tensor, indices_TK: torch.Tensor, num_experts: int):
    """Sort token copies by global expert. Returns ``(x_SH, state)``.

    ``indices_TK`` int64 global expert ids in ``[0, num_experts)``.
    """
    state = sort_by_expert(x_TH, indices_TK, num_experts)
    return expand_tokens(x_TH, state), state


def expand_tokens(x_TH: torch.Tensor, state: PermutationState) -> torch.Tensor:
    """The permuted rows of ``state``: token copies by expert, padding rows zero (differentiable)."""
    return _ExpandGather.apply(x_TH, state.token_S, state.inverse_S, state.top_k, state.pad_rows)


def expand_rows(state: PermutationState) -> RowGather:
    """The rows of :func:`expand_tokens` left to the experts (te_dist.ops.RowGather): the first GEMM
    reads them from x_TH, and the last one's output is summed back into token order, the combine of
    :func:`unpermute_tokens` without probabilities (under a per-tensor FP8 recipe both gather FP8
    bytes: of x_TH, and of the combine's output gradient). Every token is copied at least once, so
    the gather covers its source; its adjoint is the same fixed-order K-sum as the combine's."""
    return RowGather(state.token_S, state.pad_rows,
                     functools.partial(gather_sum, inverse_S=state.inverse_S, top_k=state.top_k), covers_source=True)


def permute_probs(probs_TK: torch.Tensor, state: PermutationState) -> torch.Tensor:
    """Routing probabilities in permuted row order [S] (differentiable)."""
    return permute_rows(probs_TK.reshape(-1), state.sort_idx_S, _inverse(state), state.pad_rows)


def _inverse(state: PermutationState) -> torch.Tensor:
    if state.inverse_S is None:  # a state built by hand (tests, older callers)
        state.inverse_S = inverse_permutation(state.sort_idx_S)
    return state.inverse_S


def unpermute_tokens(y_SH: torch.Tensor, state: PermutationState, probs_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Restore token order and sum each token's K expert outputs (weighted by ``probs_TK`` if given).

    The K-sum accumulates in (at least) fp32 and returns ``y_SH.dtype``. Without probabilities
    it is one gather-and-sum pass (compiled on CUDA), and its backward one gather.
    """
    if probs_TK is None:
        if state.token_S is None:  # a state built by hand
            state.token_S = torch.div(state.sort_idx_S, state.top_k, rounding_mode="floor")
        return _GatherSum.apply(y_SH, state.token_S, _inverse(state), state.top_k, state.pad_rows)
    y_flat = unpermute_rows(y_SH, state.sort_idx_S, _inverse(state), state.pad_rows)
    y_TKH = y_flat.view(state.num_tokens, state.top_k, *y_SH.shape[1:])
    acc_dtype = torch.promote_types(y_SH.dtype, torch.float32)
    y_TKH = y_TKH.to(acc_dtype) * probs_TK.to(acc_dtype).unsqueeze(-1)
    return y_TKH.sum(dim=1, dtype=acc_dtype).to(y_SH.dtype)


def _chunk_gather_index(lengths_out: torch.Tensor, starts_in: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Gather index of a chunk reorder: output row i, in chunk c of the output order, reads input row
    ``starts_in[c] + (i - start of c in the output)``. Rows past the true total (``num_rows`` may be an
    upper bound) get meaningless values, which callers slice off."""
    ends_out = torch.cumsum(lengths_out, 0)
    rows = torch.arange(num_rows, device=lengths_out.device, dtype=lengths_out.dtype)
    chunk = torch.searchsorted(ends_out, rows, right=True).clamp_(max=lengths_out.numel() - 1)
    return rows + (starts_in - (ends_out - lengths_out)).index_select(0, chunk)


def chunk_sort_index(counts_RL: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Row permutation taking rows grouped [rank][local expert] to [local expert][rank].

    ``counts_RL`` int64 [R, El] (row counts of each chunk, in arrival order); ``num_rows`` its sum,
    or any upper bound of it (then only the first ``sum`` entries are the permutation): the index can
    be built before the counts reach the host. ``x_by_expert = x[index[:total]]``. No host sync.
    """
    num_ranks, num_local = counts_RL.shape
    flat = counts_RL.reshape(-1)
    starts_rank_major = (torch.cumsum(flat, 0) - flat).view(num_ranks, num_local)
    return _chunk_gather_index(counts_RL.t().reshape(-1), starts_rank_major.t().reshape(-1), num_rows)


def chunk_unsort_index(counts_RL: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of :func:`chunk_sort_index` (rows [local expert][rank] back to [rank][local expert]),
    built the same way: ``num_rows`` may be an upper bound of the total."""
    num_ranks, num_local = counts_RL.shape
    by_expert = counts_RL.t().reshape(-1)
    starts_expert_major = (torch.cumsum(by_expert, 0) - by_expert).view(num_local, num_ranks)
    return _chunk_gather_index(counts_RL.reshape(-1), starts_expert_major.t().reshape(-1), num_rows)
