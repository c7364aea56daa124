"""Native FP8 GEMMs where the GPU has them: ``torch._scaled_mm`` (SM89+) and
``torch._scaled_grouped_mm`` (SM90/SM100), for per-tensor FP8 (DelayedScaling,
Float8CurrentScaling). Everything else, and any shape the native kernels reject, goes to the
emulated GEMMs of :mod:`.gemm` (same operand convention, same results up to accumulation order).

Why per-tensor only: torch's kernels take tensor-wise or row-wise float32 scales; they have no
1x128/128x128 block, MX or NVFP4 variant before SM100 (block-scaled FP8 on Hopper is
cutlass_kernels' job). Predicates are cached per device and never start CUDA at import.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..recipe import Format
from .gemm import emulated_gemm, emulated_grouped_gemm
from .per_tensor import CurrentScalingQuantizer, DelayedScalingQuantizer

__all__ = [
    "native_fp8_gemm_supported",
    "native_fp8_grouped_gemm_supported",
    "scaled_gemm",
    "scaled_grouped_gemm",
]

_PER_TENSOR = (DelayedScalingQuantizer, CurrentScalingQuantizer)


def _capability(device: torch.device):
    from ..support import device_capability  # the one owner of capability lookups (and its test hook)

    return device_capability(device)


def _cuda_device(device) -> Optional[torch.device]:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def native_fp8_gemm_supported(device) -> bool:
    """torch._scaled_mm exists and the device is CUDA with compute capability >= 8.9."""
    device = _cuda_device(device)
    if device is None or not hasattr(torch, "_scaled_mm"):
        return False
    return _capability(device) >= (8, 9)


def native_fp8_grouped_gemm_supported(device) -> bool:
    """torch._scaled_grouped_mm exists and the device is SM90 or SM100 class."""
    device = _cuda_device(device)
    if device is None or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return _capability(device)[0] in (9, 10)


def _native_pair(a_q, b_q) -> bool:
    if not (isinstance(a_q, _PER_TENSOR) and isinstance(b_q, _PER_TENSOR)):
        return False
    return not (a_q.fmt is Format.E5M2 and b_q.fmt is Format.E5M2)  # no e5m2 x e5m2 kernel


def scaled_gemm(a, b, a_quantizer, b_quantizer, *, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``a[M, K] @ b[K, N]`` quantized; ``torch._scaled_mm`` when supported, else :func:`emulated_gemm`.

    Not differentiable on the native path (ops call it inside their own autograd functions).
    """
    out_dtype = out_dtype or a.dtype
    use_native = (
        isinstance(a, torch.Tensor)
        and a.dim() == 2
        and isinstance(b, torch.Tensor)
        and b.dim() == 2
        and a.shape[1] == b.shape[0]
        and a.device == b.device
        and native_fp8_gemm_supported(a.device)
        and _native_pair(a_quantizer, b_quantizer)
        and all(d % 16 == 0 for d in (a.shape[0], a.shape[1], b.shape[1]))
        and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
    )
    if not use_native:
        return emulated_gemm(a, b, a_quantizer, b_quantizer, out_dtype=out_dtype)
    qa = a_quantizer(a)
    qb = b_quantizer(b.t())  # quantize [N, K]; its transpose is the column-major [K, N] operand
    return torch._scaled_mm(
        qa.data.contiguous(), qb.data.contiguous().t(), scale_a=qa.scale_inv.reshape(()), scale_b=qb.scale_inv.reshape(()), out_dtype=out_dtype
    )


def scaled_grouped_gemm(x, w, offsets, x_quantizer, w_quantizer, *, out_dtype: Optional[torch.dtype] = None):
    """Grouped ``x[T, K] @ w[E, K, N]``: ``torch._scaled_grouped_mm`` for E4M3 per-tensor operands
    with bf16 output on SM90/SM100 (the per-tensor scales broadcast to its row-wise scale vectors),
    else :func:`emulated_grouped_gemm`."""
    out_dtype = out_dtype or x.dtype
    use_native = (
        isinstance(x, torch.Tensor)
        and isinstance(w, torch.Tensor)
        and x.dim() == 2
        and w.dim() == 3
        and x.shape[1] == w.shape[1]
        and x.device == w.device
        and native_fp8_grouped_gemm_supported(x.device)
        and isinstance(x_quantizer, _PER_TENSOR)
        and isinstance(w_quantizer, _PER_TENSOR)
        and x_quantizer.fmt is Format.E4M3
        and w_quantizer.fmt is Format.E4M3
        and x.shape[1] % 16 == 0
        and w.shape[2] % 16 == 0
        and out_dtype == torch.bfloat16
        and isinstance(offsets, torch.Tensor)
        and offsets.device == x.device
    )
    if not use_native:
        return emulated_grouped_gemm(x, w, offsets, x_quantizer, w_quantizer, out_dtype=out_dtype)
    # Shape and dtype only: reading offset values would sync the host on the fast path.
    if offsets.dim() != 1 or offsets.numel() != w.shape[0] or offsets.dtype.is_floating_point:
        raise ValueError(f"offsets must be an integer tensor of shape [E={w.shape[0]}], got {offsets.dtype} {tuple(offsets.shape)}")
    num_experts, _, n = w.shape
    qx = x_quantizer(x)
    qw = w_quantizer(w.transpose(1, 2))  # [E, N, K]; transposed back it is the column-major operand
    scale_x = qx.scale_inv.reshape(1).expand(x.shape[0]).contiguous()
    scale_w = qw.scale_inv.reshape(1, 1).expand(num_experts, n).contiguous()
    return torch._scaled_grouped_mm(
        qx.data.contiguous(),
        qw.data.contiguous().transpose(1, 2),
        scale_x,
        scale_w,
        offs=offsets.to(torch.int32),
        out_dtype=out_dtype,
    )
