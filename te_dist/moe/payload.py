"""Token rows and their routing probabilities in one buffer, so one all-to-all moves both.

Why: a variable-split all-to-all costs the host a fixed share of every step (c10d's NCCL path;
figures in docs/moe.md), and the dispatch's all-to-alls are queued right after the step's one host read, while the
GPU waits for work (docs/moe.md "The host read"). Carrying each row's probability in 16 extra
bytes folds the probability all-to-all into the token one, in the forward and in the backward.

Layout: ``payload_SP`` of x's dtype, P = H + 16 / itemsize columns. Columns [0, H) hold the token
row; the next 16 bytes hold the row's probability (its bytes, bit-exact) and padding, so rows
stay 16-byte aligned for the vectorised gathers. No pass over the rows is added: the expand
gather writes straight into the payload, and the gather that sorts rows by local expert after the
all-to-all reads straight from it.

    pack_expand(x_TH, probs_S, state)                 -> payload_SP   rows by global expert
    (all-to-all of payload rows)
    unpack_rows(payload_NP, idx, inverse, H, dtype)   -> x_NH, probs_N  rows gathered by idx

The peer-rows transport (te_dist.moe.transports.peer.autograd) uses the same row layout: the expand gather
writes the payload into the sender's region and each receiver pulls the row into two column
blocks, x_NH and the tail, whose ``prob_view`` holds the probabilities.
"""

from __future__ import annotations

import torch

from .permutation import PermutationState, gather_sum

__all__ = ["PROB_BYTES", "pack_expand", "unpack_rows", "payload_columns", "prob_view"]

PROB_BYTES = 16  # per row: the probability (at most 16 bytes wide) and padding to 16-byte rows


def payload_columns(hidden: int, dtype: torch.dtype) -> int:
    """Columns of a payload carrying rows of ``hidden`` elements of ``dtype``."""
    return hidden + PROB_BYTES // dtype.itemsize


def prob_view(payload: torch.Tensor, hidden: int, probs_dtype: torch.dtype) -> torch.Tensor:
    """The [rows] view of the probabilities stored in a payload's tail bytes."""
    tail = payload[:, hidden:].view(torch.uint8)[:, :probs_dtype.itemsize]
    return tail.view(probs_dtype).squeeze(1)


class _PackExpand(torch.autograd.Function):
    """``payload[i] = (x[token_S[i]], probs_S[i])``; backward: x's gradient as the fixed-order sum
    of each token's K row gradients (:func:`gather_sum`), the probabilities' read from the tail."""

    @staticmethod
    def forward(ctx, x_TH, probs_S, token_S, inverse_S, top_k):
        hidden = x_TH.shape[1]
        payload = x_TH.new_empty(token_S.numel(), payload_columns(hidden, x_TH.dtype))
        torch.index_select(x_TH, 0, token_S, out=payload[:, :hidden])
        prob_view(payload, hidden, probs_S.dtype).copy_(probs_S)
        ctx.save_for_backward(inverse_S)
        ctx.top_k, ctx.hidden, ctx.probs_dtype = top_k, hidden, probs_S.dtype
        return payload

    @staticmethod
    def backward(ctx, grad_payload):
        (inverse_S,) = ctx.saved_tensors
        grad_x = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_x = gather_sum(grad_payload[:, :ctx.hidden], inverse_S, ctx.top_k)
        if ctx.needs_input_grad[1]:
            grad_probs = prob_view(grad_payload, ctx.hidden, ctx.probs_dtype).clone()
        return grad_x, grad_probs, None, None, None


class _UnpackRows(torch.autograd.Function):
    """``(x[idx], probs[idx])`` from a payload, each contiguous; backward packs the two gradients
    into one payload, gathered through the inverse permutation (gathers both ways, no scatter).
    ``pad_rows``: rows of the outputs that are padding (zeroed; te_dist.moe.padding)."""

    @staticmethod
    def forward(ctx, payload, idx, inverse, hidden, probs_dtype, pad_rows=None):
        ctx.save_for_backward(inverse)
        ctx.hidden = hidden
        x = payload[:, :hidden].index_select(0, idx)
        probs = prob_view(payload, hidden, probs_dtype).index_select(0, idx)
        if pad_rows is not None:
            x.index_fill_(0, pad_rows, 0)
            probs.index_fill_(0, pad_rows, 0)
        return x, probs

    @staticmethod
    def backward(ctx, grad_x, grad_probs):
        (inverse,) = ctx.saved_tensors
        hidden = ctx.hidden
        grad = grad_x.new_empty(inverse.numel(), payload_columns(hidden, grad_x.dtype))
        torch.index_select(grad_x, 0, inverse, out=grad[:, :hidden])
        prob_view(grad, hidden, grad_probs.dtype).copy_(grad_probs.index_select(0, inverse))
        return grad, None, None, None, None, None


def pack_expand(x_TH: torch.Tensor, probs_S: torch.Tensor, state: PermutationState) -> torch.Tensor:
    """Payload rows in expert order: token ``state.token_S[i]`` of ``x_TH`` and ``probs_S[i]`` (differentiable)."""
    if probs_S.shape != state.token_S.shape:  # (every torch dtype fits in PROB_BYTES)
        raise ValueError(f"expected probabilities [{state.token_S.numel()}] in permuted row order, "
                         f"got shape {tuple(probs_S.shape)}")
    return _PackExpand.apply(x_TH, probs_S, state.token_S, state.inverse_S, state.top_k)


def unpack_rows(payload: torch.Tensor, idx: torch.Tensor, inverse: torch.Tensor, hidden: int,
                probs_dtype: torch.dtype, pad_rows=None):
    """``(x_NH, probs_N)``: the payload's rows gathered by ``idx`` (``inverse``: its inverse
    permutation; ``pad_rows``: output rows that are padding, zeroed)."""
    return _UnpackRows.apply(payload, idx, inverse, hidden, probs_dtype, pad_rows)
