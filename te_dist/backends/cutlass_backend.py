"""Our CUTLASS SM90 grouped GEMMs (cutlass_kernels/) behind the backend interface.

Why: over ``torch._grouped_mm`` they add the fused epilogue (row scale + per-expert bias in the
same pass as the GEMM output), fp32 outputs, and a tile config chosen per shape. Kernels are
built on first use (cutlass_kernels.build), launched through a C ABI on the current torch stream
with a caller-allocated workspace, so calls are CUDA-graph capturable. If a build fails the
backend warns once, disables itself and the call runs on ``torch._grouped_mm``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import warnings
from pathlib import Path

import torch

from .. import support
from . import torch_backend

__all__ = ["is_available", "disable", "forward", "dgrad", "wgrad", "kernels_module"]

_state = {"disabled": False}


def kernels_module():
    """The top-level ``cutlass_kernels`` package (beside te_dist in a source checkout)."""
    ck = _state.get("module")
    if ck is None:
        try:
            ck = importlib.import_module("cutlass_kernels")
        except ImportError:
            root = str(Path(__file__).resolve().parents[2])
            if root not in sys.path:
                sys.path.append(root)
            ck = importlib.import_module("cutlass_kernels")
        _state["module"] = ck
    return ck


def _tools_present() -> bool:
    return support.cutlass_tools_present()


def is_available(device: torch.device) -> bool:
    if _state["disabled"] or os.environ.get("TE_DIST_DISABLE_CUTLASS", "0") not in ("", "0"):
        return False
    return _tools_present()


def disable(reason: str) -> None:
    if not _state["disabled"]:
        warnings.warn(f"te_dist cutlass_kernels disabled, falling back to torch._grouped_mm: {reason}", stacklevel=3)
    _state["disabled"] = True


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _f32(t):
    return None if t is None else t.float().contiguous()


# torch's C getter of the current stream's cudaStream_t: ~0.3 us, where
# ``torch.cuda.current_stream(device).cuda_stream`` cost ~6 us per call on the H200 host (a Stream
# object each time); the public form stays as the fallback for a torch without it.
_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(index: int) -> int:
    if _CURRENT_RAW_STREAM is None:
        return torch.cuda.current_stream(index).cuda_stream
    return _CURRENT_RAW_STREAM(index)


def _launch(direction: str, a, b, d, offsets_E, num_groups, n, k, scale, bias, num_rows, config=None, group_sizes=None):
    ck = kernels_module()
    device = a.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _sm_count(index)
    if config is None:
        config = ck.choose_config(direction, num_rows, n, k, num_groups, sms, group_sizes)
    lib = ck.load(direction, config, d.dtype == torch.float32)
    ws = torch.empty(lib.workspace_bytes(num_groups, sms), dtype=torch.uint8, device=device)
    stream = _raw_stream(index)
    rc = lib.run(a.data_ptr(), b.data_ptr(), d.data_ptr(), offsets_E.data_ptr(), num_groups, n, k,
                 scale.data_ptr() if scale is not None else None, bias.data_ptr() if bias is not None else None,
                 ws.data_ptr(), ws.numel(), sms, index, stream)
    if rc != 0:
        raise RuntimeError(f"cutlass_kernels {direction} (config {config}) failed: {lib.last_error()}")


def _guard(fallback):
    """Run the CUTLASS path; on a build failure disable it and use the torch backend instead."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if not _state["disabled"]:
                try:
                    return fn(*args, **kwargs)
                except kernels_module().BuildError as exc:
                    disable(str(exc))
            kwargs.pop("config", None)  # a tile config means nothing to the fallback,
            kwargs.pop("group_sizes", None)  # nor do sizes that only pick one
            return fallback(*args, **kwargs)

        return inner

    return wrap


@_guard(torch_backend.forward)
def forward(x_TK, w_EKN, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=None, *, config=None, group_sizes=None):
    out_dtype = out_dtype or x_TK.dtype
    E, K, N = w_EKN.shape
    T = x_TK.shape[0]
    y_TN = torch.empty(T, N, device=x_TK.device, dtype=out_dtype)
    if T == 0 or E == 0:
        return y_TN
    w_ENK = w_EKN.transpose(1, 2)
    assert w_ENK.is_contiguous(), "selection only routes K-major weights here"
    _launch("fwd", _aligned(x_TK), _aligned(w_ENK), y_TN, offsets_E, E, N, K, _f32(row_scale_T), _f32(bias_EN), T,
            config, group_sizes)
    return y_TN


@_guard(torch_backend.dgrad)
def dgrad(dy_TN, w_EKN, offsets_E, row_scale_T=None, out_dtype=None, *, config=None, group_sizes=None):
    out_dtype = out_dtype or dy_TN.dtype
    E, K, N = w_EKN.shape
    T = dy_TN.shape[0]
    dx_TK = torch.empty(T, K, device=dy_TN.device, dtype=out_dtype)
    if T == 0 or E == 0:
        return dx_TK
    w_ENK = w_EKN.transpose(1, 2)
    assert w_ENK.is_contiguous(), "selection only routes K-major weights here"
    _launch("dgrad", _aligned(dy_TN), _aligned(w_ENK), dx_TK, offsets_E, E, N, K, _f32(row_scale_T), None, T, config,
            group_sizes)
    return dx_TK


@_guard(torch_backend.wgrad)
def wgrad(x_TK, dy_TN, offsets_E, num_groups: int, out_dtype=None, *, config=None):
    out_dtype = out_dtype or x_TK.dtype
    K, N = x_TK.shape[1], dy_TN.shape[1]
    T = x_TK.shape[0]
    if T == 0 or num_groups == 0:
        return torch.zeros(num_groups, N, K, device=x_TK.device, dtype=out_dtype).transpose(1, 2)
    dw_ENK = torch.empty(num_groups, N, K, device=x_TK.device, dtype=out_dtype)
    _launch("wgrad", _aligned(dy_TN), _aligned(x_TK), dw_ENK, offsets_E, num_groups, N, K, None, None, T, config)
    return dw_ENK.transpose(1, 2)
