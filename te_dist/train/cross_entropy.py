"""The language-model loss: mean next-token cross-entropy in float32 math over low-precision logits.

Why a kernel of our own: ``F.cross_entropy(logits.float(), targets)`` over a [T, V] bf16 logit matrix moves about
34 bytes per logit (the float32 copy, log-softmax forward and backward in float32, the copy's backward); at 32k
tokens x 32k vocabulary that is 11-17 ms of an H100 step, the same in every recipe's arm. The fused path reads the
bf16 logits once forward (an online max and sum of exponentials per row, float32) and once backward, writing the
bf16 gradient ``(softmax - onehot) * g / T`` directly: 6 bytes per logit. Same float32 math, so the same loss to
rounding. Triton is imported on the first fused call only (CUDA); elsewhere the reference path runs. Under
Float8CurrentScaling the backward also finds max |gradient| for the LM head's cast of it
(te_dist.quantization.amax_hints: no amax pass over the [T, V] gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import settings
from ..autocast import get_active_recipe
from ..quantization import amax_hints
from ..quantization.api import QUANTIZER_TYPES

__all__ = ["cross_entropy", "forward_rows", "fused_available"]

_BLOCK = 4096  # logits of one row read per loop iteration (bf16: 8 KiB)
_kernels = None  # (forward, backward) once compiled


def _build():
    """The two Triton kernels (one program per row; the vocabulary walked in ``BLOCK`` chunks)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _cross_entropy_forward(logits, row_stride, targets, loss, lse, dmax, V, CHUNKS: tl.constexpr,
                               BLOCK: tl.constexpr, DMAX: tl.constexpr, LANE: tl.constexpr, CHUNKS_P2: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        offs = tl.arange(0, BLOCK)
        target = tl.load(targets + row)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max and sum of exp(x - m)
        s = tl.zeros([BLOCK], tl.float32)
        other = tl.full([BLOCK], float("-inf"), tl.float32)  # DMAX: per-lane max of the non-target logits
        for i in range(CHUNKS):
            start = i * BLOCK
            x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            s = tl.where(m_new == float("-inf"), 0.0, s)  # lanes that saw only padding
            m = m_new
            if DMAX:
                if LANE == 0:  # the target masked at every element
                    other = tl.maximum(other, tl.where(start + offs == target, float("-inf"), x))
        row_max = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - row_max), 0)
        row_lse = row_max + tl.log(total)
        inside = (target >= 0) & (target < V)  # else no read off the row: a NaN loss, which the loop reports
        picked = tl.load(base + target, mask=inside, other=float("nan")).to(tl.float32)
        tl.store(lse + row, row_lse)
        tl.store(loss + row, row_lse - picked)
        if DMAX:  # max |softmax - onehot| of the row, each term as the backward computes it (exp is monotone)
            if LANE == 0:
                non_target = tl.max(other, 0)
            else:  # m is each lane's max: only the target's lane needs its other chunks, read once, strided
                lane = target % BLOCK
                k = tl.arange(0, CHUNKS_P2)
                cols = k * BLOCK + lane
                keep = (k < CHUNKS) & (k != target // BLOCK) & (cols < V) & inside
                lane_x = tl.load(base + cols, mask=keep, other=float("-inf")).to(tl.float32)
                rest = tl.max(tl.where(offs == lane, float("-inf"), m), 0)
                non_target = tl.where(inside, tl.maximum(rest, tl.max(lane_x, 0)), tl.max(m, 0))
            d = tl.maximum(tl.exp(non_target - row_lse), tl.abs(tl.exp(picked - row_lse) - 1.0))
            bits = d.to(tl.int32, bitcast=True)
            if bits > tl.load(dmax):  # triton_fp8_math._merge_amax's rule
                tl.atomic_max(dmax, bits)

    @triton.jit
    def _cross_entropy_backward(logits, row_stride, targets, lse, grad_loss, grad_logits, amax, V,
                                CHUNKS: tl.constexpr, inv_rows, AMAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        out = grad_logits + row * V
        offs = tl.arange(0, BLOCK)
        scale = tl.load(grad_loss).to(tl.float32) * inv_rows
        row_lse = tl.load(lse + row)
        target = tl.load(targets + row)
        top = tl.zeros([BLOCK], tl.int32)
        for i in range(CHUNKS):
            cols = i * BLOCK + offs
            inside = cols < V
            x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
            g = (tl.exp(x - row_lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            stored = g.to(grad_logits.dtype.element_ty)
            tl.store(out + cols, stored, mask=inside)
            if AMAX:  # max |grad| as stored, as int32 float32 bits (quantization.amax_hints)
                bits = stored.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
                top = tl.maximum(top, tl.where(inside, bits, 0))
        if AMAX:
            row_top = tl.max(top, 0)
            if row_top > tl.load(amax):  # triton_fp8_math._merge_amax's rule (these kernels are built without imports)
                tl.atomic_max(amax, row_top)

    return _cross_entropy_forward, _cross_entropy_backward


def forward_rows(logits_TV: torch.Tensor, targets_T: torch.Tensor, dmax_bits=None):
    """(loss_T, lse_T) of the fused forward kernel, float32; with ``dmax_bits`` (int32 [1], zeroed) it also merges
    max |softmax - onehot| over the logits into it as float32 bits (te_dist.train.head_loss: the amax of the
    logits' gradient before the backward writes it)."""
    global _kernels
    if _kernels is None:
        _kernels = _build()
    T, V = logits_TV.shape
    loss_T = torch.empty(T, device=logits_TV.device, dtype=torch.float32)
    lse_T = torch.empty_like(loss_T)
    dmax = lse_T if dmax_bits is None else dmax_bits  # a placeholder pointer when DMAX is off
    chunks = -(-V // _BLOCK)
    lane = int(dmax_bits is not None and settings.current().head_loss_lane_max)
    _kernels[0][(T,)](logits_TV, logits_TV.stride(0), targets_T, loss_T, lse_T, dmax, V, chunks,
                      BLOCK=_BLOCK, DMAX=dmax_bits is not None, LANE=lane,
                      CHUNKS_P2=1 << max(chunks - 1, 0).bit_length(), num_warps=8)
    return loss_T, lse_T


def fused_available(logits_TV: torch.Tensor) -> bool:
    """Whether the fused path takes these logits: on CUDA, 2-D with unit column stride, Triton importable."""
    if not (logits_TV.is_cuda and logits_TV.dim() == 2 and logits_TV.stride(1) == 1):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, targets_T):
        T = logits_TV.shape[0]
        loss_T, lse_T = forward_rows(logits_TV, targets_T)
        ctx.save_for_backward(logits_TV, targets_T, lse_T)
        # where the recipe's quantizers take amax hints (current scaling), the LM head's backward casts this gradient
        ctx.tell_amax = getattr(QUANTIZER_TYPES.get(type(get_active_recipe())), "takes_amax_hint", False)
        return loss_T.sum() / T

    @staticmethod
    def backward(ctx, grad):
        logits_TV, targets_T, lse_T = ctx.saved_tensors
        T, V = logits_TV.shape
        grad_TV = torch.empty((T, V), device=logits_TV.device, dtype=logits_TV.dtype)
        bits = amax_hints.new_bits(grad_TV.device) if ctx.tell_amax else lse_T
        _kernels[1][(T,)](logits_TV, logits_TV.stride(0), targets_T, lse_T, grad.contiguous(), grad_TV, bits, V,
                          -(-V // _BLOCK), 1.0 / T, AMAX=ctx.tell_amax, BLOCK=_BLOCK, num_warps=8)
        if ctx.tell_amax:
            amax_hints.offer(grad_TV, bits)
        return grad_TV, None


def cross_entropy(logits_TV: torch.Tensor, targets_T: torch.Tensor, *, fused: bool = True) -> torch.Tensor:
    """Mean cross-entropy of ``logits_TV`` [T, V] against class indices ``targets_T`` [T], a float32 scalar.
    ``fused``: the Triton kernels where :func:`fused_available` says so, else ``F.cross_entropy`` on the logits cast
    to float32 (the reference; also the CPU path). Targets belong in [0, V): the fused path has no ``ignore_index``
    and gives a NaN loss for a target outside (read on the GPU, so without a host sync)."""
    if logits_TV.dim() != 2 or targets_T.shape != logits_TV.shape[:1]:
        raise ValueError(f"cross_entropy expects logits [T, V] and targets [T], received {tuple(logits_TV.shape)} "
                         f"and {tuple(targets_T.shape)}")
    if fused and fused_available(logits_TV):
        return _FusedCrossEntropy.apply(logits_TV, targets_T.contiguous())
    return F.cross_entropy(logits_TV.float(), targets_T)
