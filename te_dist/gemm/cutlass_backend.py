"""Our CUTLASS SM90 grouped GEMMs (cutlass_kernels/) behind the backend interface, bf16 and FP8.

What they add over torch's kernels: the fused epilogue (row scale + per-expert bias in the GEMM's output pass), float32
outputs, block-scaled and tensor-scaled FP8 (torch has no block-scaled grouped FP8 GEMM), and a tile per shape
(cutlass_kernels/heuristics.py). Kernels are built on first use, launched through a C ABI on the current stream with a
caller-allocated workspace: no host sync, CUDA-graph capturable. A bf16 build that fails warns once, disables the bf16
kernels and the call runs on torch._grouped_mm; an FP8 instance that fails to build warns once and its calls run
emulated; an FP8 library that fails to load marks the FP8 kernels unavailable (the support predicates then answer False)
and ``te-dist env`` shows why.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .. import settings as _settings
from .. import support
from . import torch_backend
from .fp8_operands import columnwise_operand, fp8_format, one_scale, rowwise_operand, tensor_scales

__all__ = ["kernels_module", "is_available", "disable", "forward", "dgrad", "wgrad", "fp8_forward", "fp8_dgrad",
           "fp8_wgrad", "fp8_guarded"]

_state = {"disabled": False}


def kernels_module():
    """The top-level ``cutlass_kernels`` package (installed beside te_dist), imported on first use."""
    import cutlass_kernels

    return cutlass_kernels


def is_available(device: torch.device) -> bool:
    """The bf16 kernels can run here: not turned off (``te_dist.settings.cutlass``) nor by a failed build,
    tools found."""
    return not _state["disabled"] and not support.cutlass_disabled() and support.cutlass_tools_present()


def disable(reason: str) -> None:
    if not _state["disabled"]:
        warnings.warn(f"te_dist cutlass_kernels disabled, falling back to torch._grouped_mm: {reason}", stacklevel=3)
    _state["disabled"] = True
    support.clear_caches()  # the call path's remembered choices read this state


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# torch's C getter of the current stream's cudaStream_t (a Stream object per call costs far more);
# the public form stays as the fallback for a torch without it.
_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(index: int) -> int:
    return _CURRENT_RAW_STREAM(index) if _CURRENT_RAW_STREAM else torch.cuda.current_stream(index).cuda_stream


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _f32(t):
    return None if t is None else t.float().contiguous()


def _ptr(t):
    return None if t is None else t.data_ptr()


def _run_library(lib, what: str, device, num_groups: int, *args) -> None:
    """``lib.run(*args, workspace, its bytes, SMs, device index, stream)`` with a fresh workspace on the
    current stream; a failed launch raises naming ``what`` and the library's error."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _sm_count(index)
    ws = torch.empty(lib.workspace_bytes(num_groups, sms), dtype=torch.uint8, device=device)
    if lib.run(*args, ws.data_ptr(), ws.numel(), sms, index, _raw_stream(index)) != 0:
        raise RuntimeError(f"cutlass_kernels {what} failed: {lib.last_error()}")


def _launch(direction: str, a, b, d, offsets_E, num_groups, n, k, scale, bias, num_rows, config=None, group_sizes=None):
    ck = kernels_module()
    if config is None:
        config = ck.choose_config(direction, num_rows, n, k, num_groups, group_sizes)
    _run_library(ck.load(direction, config, d.dtype == torch.float32), f"{direction} (config {config})", a.device,
                 num_groups, a.data_ptr(), b.data_ptr(), d.data_ptr(), offsets_E.data_ptr(), num_groups, n, k,
                 _ptr(scale), _ptr(bias))


def _guard(fallback):
    """Run the CUTLASS path; on a build failure disable it and run ``fallback`` (the torch backend)."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, config=None, **kwargs):
            if not _state["disabled"]:
                try:
                    return fn(*args, config=config, **kwargs)
                except kernels_module().BuildError as exc:
                    disable(str(exc))
            return fallback(*args, **kwargs)  # a tile config means nothing to it

        return inner

    return wrap


def _k_major(w_EKN):
    w_ENK = w_EKN.transpose(1, 2)
    assert w_ENK.is_contiguous(), "the decision routes only K-major weights here"
    return _aligned(w_ENK)


def _rows(direction, a, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, config, group_sizes):
    """fwd (a = x, out [T, N]) or dgrad (a = dy, out [T, K]) against the K-major weight."""
    E, K, N = w_EKN.shape
    T = a.shape[0]
    out = torch.empty(T, N if direction == "fwd" else K, device=a.device, dtype=out_dtype or a.dtype)
    if T and E:
        _launch(direction, _aligned(a), _k_major(w_EKN), out, offsets_E, E, N, K, _f32(row_scale_T), _f32(bias_EN), T,
                config, group_sizes)
    return out


@_guard(torch_backend.forward)
def forward(x_TK, w_EKN, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=None, group_sizes=None, *, config=None):
    return _rows("fwd", x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, config, group_sizes)


@_guard(torch_backend.dgrad)
def dgrad(dy_TN, w_EKN, offsets_E, row_scale_T=None, out_dtype=None, group_sizes=None, *, config=None):
    return _rows("dgrad", dy_TN, w_EKN, offsets_E, None, row_scale_T, out_dtype, config, group_sizes)


@_guard(torch_backend.wgrad)
def wgrad(x_TK, dy_TN, offsets_E, num_groups: int, out_dtype=None, group_sizes=None, *, config=None):
    (T, K), N = x_TK.shape, dy_TN.shape[1]
    out_dtype = out_dtype or x_TK.dtype
    if T == 0 or num_groups == 0:
        return torch.zeros(num_groups, N, K, device=x_TK.device, dtype=out_dtype).transpose(1, 2)
    dw_ENK = torch.empty(num_groups, N, K, device=x_TK.device, dtype=out_dtype)
    _launch("wgrad", _aligned(dy_TN), _aligned(x_TK), dw_ENK, offsets_E, num_groups, N, K, None, None, T, config)
    return dw_ENK.transpose(1, 2)


# --------------------------------------------------------------------------- FP8


def _forced_fp8_tile(fb, direction, current):
    """``te_dist.settings.fp8_tile``, else a wgrad's ``fp8_wgrad_tile`` (None: the rule), checked against the tiles."""
    name = "fp8_wgrad_tile" if direction == "wgrad" and current.fp8_tile is None else "fp8_tile"
    if (tile := getattr(current, name)) is not None and tile not in fb.FP8_CONFIGS:
        raise ValueError(f"te_dist.settings.{name}={tile} names no FP8 tile (set by {_settings.source(name)}); "
                         f"the tiles are {sorted(fb.FP8_CONFIGS)}")
    return tile


def _launch_fp8(direction, a, a_scale, b, b_scale, d, offsets_E, num_groups, n, k, num_rows, bias, row_scale,
                group_sizes, per_tensor: bool, accumulate: bool = False):
    """One FP8 kernel call; ``per_tensor``: a_scale and b_scale are one float each (the
    tensor-scaled instances), else block-scale tables; ``accumulate``: wgrad adds into ``d``."""
    fb, current = kernels_module().fp8_block, _settings.current()
    config = fb.choose_fp8_config(direction, num_rows, num_groups, group_sizes, contraction=k,
                                  columns=n if direction == "fwd" else k, tensor_scales=per_tensor,
                                  fast=current.fp8_fprop_fast_accum, forced=_forced_fp8_tile(fb, direction, current))
    lib = fb.load_fp8(direction, config, fp8_format(a), fp8_format(b), d.dtype == torch.float32, per_tensor, accumulate)
    scratch = None
    if direction != "wgrad" and not per_tensor:
        scratch = torch.empty(a_scale.numel(), dtype=torch.float32, device=a.device)
    _run_library(lib, f"FP8 {direction} (config {config})", a.device, num_groups, a.data_ptr(), b.data_ptr(),
                 d.data_ptr(), a_scale.data_ptr(), b_scale.data_ptr(), _ptr(scratch), offsets_E.data_ptr(),
                 num_groups, n, k, num_rows, _ptr(row_scale), _ptr(bias))


def _fp8_rows(direction, aq, wq, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes):
    """fwd or dgrad: the rowwise operand ``aq`` against the QuantizedWeight's copy for ``direction``."""
    E, N, K = wq.shape
    per_tensor = tensor_scales(aq, wq)
    a, a_scale = rowwise_operand(aq, scale_tables=not per_tensor)
    b, b_scale = (wq.fwd_data, wq.fwd_scale) if direction == "fwd" else (wq.dgrad_data, wq.dgrad_scale)
    out = torch.empty(a.shape[0], N if direction == "fwd" else K, device=a.device, dtype=out_dtype)
    if a.shape[0] and E:
        _launch_fp8(direction, a, a_scale, b, one_scale(wq) if per_tensor else b_scale, out, offsets_E, E, N, K,
                    a.shape[0], _f32(bias_EN), _f32(row_scale_T), group_sizes, per_tensor)
    return out


def fp8_forward(xq, wq, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=torch.bfloat16, group_sizes=None):
    """y[T, N] = row_scale * (x @ w[e]^T) + bias[e] from a quantized x [T, K] and a QuantizedWeight."""
    return _fp8_rows("fwd", xq, wq, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes)


def fp8_dgrad(dyq, wq, offsets_E, out_dtype=torch.bfloat16, group_sizes=None):
    """dx[T, K] = dy @ w[e] from a quantized dy [T, N] and a QuantizedWeight."""
    return _fp8_rows("dgrad", dyq, wq, offsets_E, None, None, out_dtype, group_sizes)


def fp8_wgrad(xq, dyq, offsets_E, num_groups: int, out_dtype=torch.bfloat16, group_sizes=None, out=None):
    """dw[e] = dy_e^T @ x_e as [E, N, K] from columnwise copies (every group's first row aligned;
    no size-dependent tile: wgrad pads no rows); ``out``: dw added into it in the kernel's epilogue."""
    (T, K), N = xq.shape, dyq.shape[1]
    per_tensor = tensor_scales(xq, dyq)
    dyT, dyT_scale = columnwise_operand(dyq, scale_tables=not per_tensor)
    xT, xT_scale = columnwise_operand(xq, scale_tables=not per_tensor)
    dw = torch.empty(num_groups, N, K, device=dyT.device, dtype=out_dtype) if out is None else out
    if num_groups and T == 0 and out is None:
        dw.zero_()
    elif num_groups and T:
        _launch_fp8("wgrad", dyT, dyT_scale, xT, xT_scale, dw, offsets_E, num_groups, N, K, T, None, None, None,
                    per_tensor, out is not None)
    return dw


_warned: set = set()


def fp8_guarded(fn, fallback):
    """Run ``fn``; an instance that fails to build runs ``fallback`` (warned once per instance); a
    library that fails to load marks the FP8 kernels unavailable."""

    def inner(*args, **kwargs):
        if support.fp8_kernels_available():
            try:
                return fn(*args, **kwargs)
            except kernels_module().BuildError as exc:
                message = str(exc).splitlines()[0][:300]
                if message not in _warned:
                    _warned.add(message)
                    warnings.warn(f"te_dist FP8 grouped-GEMM kernel failed to build, running emulated: {message}",
                                  stacklevel=3)
            except OSError as exc:
                warnings.warn(f"te_dist FP8 grouped-GEMM kernels disabled, FP8 GEMMs run emulated: {exc}", stacklevel=3)
                support.mark_fp8_kernels_unavailable(f"{type(exc).__name__}: {exc}")
        return fallback(*args, **kwargs)

    return inner
