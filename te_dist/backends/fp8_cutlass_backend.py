"""FP8 grouped GEMMs on our CUTLASS SM90 kernels (cutlass_kernels/fp8_block_gemm.cu).

Why our own: torch's ``_scaled_grouped_mm`` takes row-wise scales only (no 1x128 / 128x128
blocks), has no e5m2 gradient operand on Hopper and no fused bias. These kernels take every FP8
recipe on Hopper: block scales as they are; per-tensor scales on the tensor-scaled instances, which
apply the two operands' scales in the epilogue (:mod:`.fp8_operands` makes the layouts). Built on
first use through the bf16 kernels' JIT cache; launched on the current stream with a
caller-allocated workspace, no host sync. An instance that fails to build warns once and its calls
run emulated (the other instances stay in use); a library that fails to load marks the kernels
unavailable (the support predicates then answer False, so calls take the emulated path), and
``te-dist env`` shows the reason.
"""

from __future__ import annotations

import warnings

import torch

from .. import support
from .cutlass_backend import _raw_stream, _sm_count, kernels_module
from .fp8_operands import BLOCK, columnwise_operand, fp8_format, one_scale, rowwise_operand, tensor_scales

__all__ = ["available", "disable", "forward", "dgrad", "wgrad"]

def available() -> bool:
    """The kernels can be built (nvcc and CUTLASS headers found) and none failed to load."""
    return support.fp8_kernels_available()


def unavailable_reason() -> str:
    return support.fp8_kernels_unavailable_reason()


def disable(reason: str) -> None:
    if available():
        warnings.warn(f"te_dist FP8 grouped-GEMM kernels disabled, FP8 GEMMs run emulated: {reason}", stacklevel=3)
    support.mark_fp8_kernels_unavailable(reason)  # cached answers said "native": they are dropped


def _module():
    return kernels_module().fp8_block


def _launch(direction, a, a_scale, b, b_scale, d, offsets_E, num_groups, n, k, num_rows, bias, row_scale, group_sizes,
            per_tensor: bool):
    """One kernel call; ``per_tensor``: a_scale and b_scale are each one float (the tensor-scaled
    instance), else block-scale tables."""
    device = a.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _sm_count(index)
    fb = _module()
    config = fb.choose_fp8_config(direction, num_rows, num_groups, group_sizes)
    lib = fb.load_fp8(direction, config, fp8_format(a), fp8_format(b), d.dtype == torch.float32, per_tensor)
    ws = torch.empty(lib.workspace_bytes(num_groups, sms), dtype=torch.uint8, device=device)
    scratch = None
    if direction != "wgrad" and not per_tensor:
        scratch = torch.empty(a_scale.numel(), dtype=torch.float32, device=device)
    rc = lib.run(a.data_ptr(), b.data_ptr(), d.data_ptr(), a_scale.data_ptr(), b_scale.data_ptr(),
                 scratch.data_ptr() if scratch is not None else None, offsets_E.data_ptr(), num_groups, n, k,
                 num_rows, row_scale.data_ptr() if row_scale is not None else None,
                 bias.data_ptr() if bias is not None else None, ws.data_ptr(), ws.numel(), sms, index,
                 _raw_stream(index))
    if rc != 0:
        raise RuntimeError(f"cutlass_kernels FP8 {direction} (config {config}) failed: {lib.last_error()}")


def _f32(t):
    return None if t is None else t.float().contiguous()


def forward(xq, wq, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=torch.bfloat16, group_sizes=None):
    """y[T, N] = row_scale * (x @ w[e]^T) + bias[e] from a quantized x [T, K] and a QuantizedWeight."""
    E, N, K = wq.shape
    per_tensor = tensor_scales(xq, wq)
    x, x_scale = rowwise_operand(xq, scale_tables=not per_tensor)
    T = x.shape[0]
    y = torch.empty(T, N, device=x.device, dtype=out_dtype)
    if T and E:
        w_scale = one_scale(wq) if per_tensor else wq.fwd_scale
        _launch("fwd", x, x_scale, wq.fwd_data, w_scale, y, offsets_E, E, N, K, T, _f32(bias_EN),
                _f32(row_scale_T), group_sizes, per_tensor)
    return y


def dgrad(dyq, wq, offsets_E, out_dtype=torch.bfloat16, group_sizes=None):
    """dx[T, K] = dy @ w[e] from a quantized dy [T, N] and a QuantizedWeight."""
    E, N, K = wq.shape
    per_tensor = tensor_scales(dyq, wq)
    dy, dy_scale = rowwise_operand(dyq, scale_tables=not per_tensor)
    T = dy.shape[0]
    dx = torch.empty(T, K, device=dy.device, dtype=out_dtype)
    if T and E:
        w_scale = one_scale(wq) if per_tensor else wq.dgrad_scale
        _launch("dgrad", dy, dy_scale, wq.dgrad_data, w_scale, dx, offsets_E, E, N, K, T, None, None,
                group_sizes, per_tensor)
    return dx


def wgrad(xq, dyq, offsets_E, num_groups: int, out_dtype=torch.bfloat16):
    """dw[e] = dy_e^T @ x_e as [E, N, K] from columnwise copies (every group's first row aligned)."""
    T, K = xq.shape
    N = dyq.shape[1]
    per_tensor = tensor_scales(xq, dyq)
    dyT, dyT_scale = columnwise_operand(dyq, scale_tables=not per_tensor)
    xT, xT_scale = columnwise_operand(xq, scale_tables=not per_tensor)
    dw = torch.empty(num_groups, N, K, device=dyT.device, dtype=out_dtype)
    if num_groups == 0:
        return dw
    if T == 0:
        return dw.zero_()
    _launch("wgrad", dyT, dyT_scale, xT, xT_scale, dw, offsets_E, num_groups, N, K, T, None, None, None, per_tensor)
    return dw


_warned: set = set()


def guarded(fn, fallback):
    """Run ``fn``; an instance that fails to build runs ``fallback`` (warned once per instance); a
    library that fails to load disables the kernels."""

    def inner(*args, **kwargs):
        if available():
            try:
                return fn(*args, **kwargs)
            except kernels_module().BuildError as exc:
                message = str(exc).splitlines()[0][:300]
                if message not in _warned:
                    _warned.add(message)
                    warnings.warn(f"te_dist FP8 grouped-GEMM kernel failed to build, running emulated: {message}",
                                  stacklevel=3)
            except OSError as exc:
                disable(f"{type(exc).__name__}: {exc}")
        return fallback(*args, **kwargs)

    return inner


__all__ += ["guarded", "unavailable_reason", "BLOCK"]
