"""Emulated quantized GEMMs: quantize -> dequantize -> matmul in float32, on every device.

Why: they are the numerical reference for native kernels and the fallback wherever no native
kernel exists (CPU, MXFP8/NVFP4 before SM100, block-scaled FP8 without cutlass_kernels).

Operand convention (matches every GEMM of a linear layer, ``y = x @ w.T``):
  ``emulated_gemm(a[M, K], b[K, N])``: ``a`` is quantized along its last dim (rowwise) and ``b``
  along its first dim (columnwise), i.e. both along the reduction dim K.
    fprop  y  = x @ w.T    -> emulated_gemm(x, w.t(), input_q, weight_q)
    dgrad  dx = dy @ w     -> emulated_gemm(dy, w, grad_q, weight_q)
    wgrad  dw = dy.T @ x   -> emulated_gemm(dy.t(), x, grad_q, input_q)
  NVFP4's random Hadamard transform is applied to both operands exactly when both quantizers ask
  for it (input and grad_output do, weights never), which is the wgrad GEMM; being orthogonal,
  it cancels in the product.
Dims a block format cannot tile are zero-padded here (zeros change neither block scales nor the
product) and the result is sliced back, so any shape works. A quantizer of ``None`` leaves that
operand in high precision. Gradients flow straight through the quantization (a backward in
high precision on the dequantized operands); these functions are references, not fast paths.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .api import fake_quantize
from .formats import check_input
from .quantizer import Quantizer

__all__ = ["emulated_gemm", "emulated_grouped_gemm"]


def _check_quantizer(q, what: str) -> None:
    if q is not None and not isinstance(q, Quantizer):
        raise TypeError(f"{what} must be a Quantizer or None, got {type(q).__name__}")


def _pad_dim(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = x.shape[dim]
    extra = -size % multiple
    if extra == 0:
        return x
    pad = [0, 0] * x.dim()
    pad[2 * (x.dim() - 1 - (dim % x.dim())) + 1] = extra  # F.pad lists dims last-first, (left, right)
    return F.pad(x, pad)


def _block(q: Optional[Quantizer]):
    return (1, 1) if q is None else q.block_shape


def _rht(a_q: Optional[Quantizer], b_q: Optional[Quantizer]) -> bool:
    return a_q is not None and b_q is not None and a_q.wants_rht and b_q.wants_rht


def _fq(x: torch.Tensor, q: Optional[Quantizer], usage: str, rht: bool) -> torch.Tensor:
    if q is None:
        return x
    return fake_quantize(x, q, usage=usage, hadamard=rht)


def emulated_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_quantizer: Optional[Quantizer],
    b_quantizer: Optional[Quantizer],
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``a[M, K] @ b[K, N]`` with both operands quantized along K; output in ``out_dtype or a.dtype``."""
    check_input(a, "a")
    check_input(b, "b")
    _check_quantizer(a_quantizer, "a_quantizer")
    _check_quantizer(b_quantizer, "b_quantizer")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"emulated_gemm needs a[M, K] and b[K, N], got a{tuple(a.shape)} and b{tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    m, n = a.shape[0], b.shape[1]
    (a_br, a_bc), (b_br, b_bc) = _block(a_quantizer), _block(b_quantizer)
    k_multiple = math.lcm(a_bc, b_bc)
    a_p = _pad_dim(_pad_dim(a, 1, k_multiple), 0, a_br)
    b_p = _pad_dim(_pad_dim(b, 0, k_multiple), 1, b_br)
    rht = _rht(a_quantizer, b_quantizer)
    a_dq = _fq(a_p, a_quantizer, "rowwise", rht)
    b_dq = _fq(b_p, b_quantizer, "columnwise", rht)
    out = a_dq.to(torch.float32) @ b_dq.to(torch.float32)
    return out[:m, :n].to(out_dtype or a.dtype)


def _check_offsets(offsets: torch.Tensor, num_groups: int, num_rows: int) -> list:
    if not isinstance(offsets, torch.Tensor) or offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
        raise TypeError(f"offsets must be an integer tensor, got {getattr(offsets, 'dtype', type(offsets).__name__)}")
    if offsets.dim() != 1 or offsets.numel() != num_groups:
        raise ValueError(f"offsets must have shape [E={num_groups}], got {tuple(offsets.shape)}")
    ends = offsets.tolist()  # host sync: acceptable for a reference path
    starts = [0] + ends[:-1]
    if any(e < s for s, e in zip(starts, ends)) or (ends and ends[0] < 0):
        raise ValueError(f"offsets must be non-decreasing cumulative end indices >= 0, got {ends}")
    if (ends[-1] if ends else 0) != num_rows:
        raise ValueError(f"offsets must end at the number of rows {num_rows}, got {ends[-1] if ends else 0}")
    return ends


def emulated_grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    x_quantizer: Optional[Quantizer],
    w_quantizer: Optional[Quantizer],
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``x[T, K]`` times ``w[e]`` (``w[E, K, N]``; a transposed view
    of ``[E, N, K]`` is fine). x is quantized once along K (rowwise), w once along K (columnwise,
    per-tensor formats: one scale over all experts). Zero-row groups are fine."""
    check_input(x, "x")
    check_input(w, "w")
    _check_quantizer(x_quantizer, "x_quantizer")
    _check_quantizer(w_quantizer, "w_quantizer")
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"emulated_grouped_gemm needs x[T, K] and w[E, K, N], got x{tuple(x.shape)} and w{tuple(w.shape)}")
    if x.device != w.device:
        raise ValueError(f"x and w must be on one device, got {x.device} and {w.device}")
    ends = _check_offsets(offsets, w.shape[0], x.shape[0])
    t, n = x.shape[0], w.shape[2]
    (x_br, x_bc), (w_br, w_bc) = _block(x_quantizer), _block(w_quantizer)
    k_multiple = math.lcm(x_bc, w_bc)
    x_p = _pad_dim(_pad_dim(x, 1, k_multiple), 0, x_br)
    w_p = _pad_dim(_pad_dim(w, 1, k_multiple), 2, w_br)
    rht = _rht(x_quantizer, w_quantizer)
    x_dq = _fq(x_p, x_quantizer, "rowwise", rht).to(torch.float32)
    w_dq = _fq(w_p, w_quantizer, "columnwise", rht).to(torch.float32)
    pieces, start = [], 0
    for e, end in enumerate(ends):
        pieces.append(x_dq[start:end] @ w_dq[e])
        start = end
    out = torch.cat(pieces, 0) if pieces else x_dq.new_zeros((0, w_dq.shape[2]))
    return out[:t, :n].to(out_dtype or x.dtype)
