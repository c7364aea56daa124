"""``torch._grouped_mm`` backend (one launch on SM90 bf16; a host-syncing loop elsewhere in torch).

Why: it is the strong baseline on Hopper and the fallback when our CUTLASS kernels cannot run.
Its output dtype must match the input, so the epilogue (row scale, bias) runs as separate,
unfused torch kernels: the cost our fused CUTLASS epilogue removes.
"""

from __future__ import annotations

import torch

from .epilogue import apply_epilogue

__all__ = ["is_available", "load", "forward", "dgrad", "wgrad"]

_LOADED: set = set()  # (device type, index) of the devices this process has made its first torch._grouped_mm on


def is_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def load(device: torch.device) -> None:
    """Make this process's first ``torch._grouped_mm`` on ``device`` a tiny one (once per device).

    Why: the first call of a process loads torch's grouped-GEMM kernels. On the H200 that made a
    2.6 ms DeepSeek-V3 fc1 call take 12 ms (20 ms in one sweep, the measuring bucket's torch sample
    then passing its 50 ms), where a first call on 32 rows of 64 took 3 ms and the large call after it
    2.8 ms. The tuner calls this before timing a bucket, as it opens the CUTLASS libraries."""
    key = (device.type, device.index if device.index is not None or device.type != "cuda" else
           torch.cuda.current_device())
    if key in _LOADED:
        return
    _LOADED.add(key)
    x = torch.zeros(32, 64, device=device, dtype=torch.bfloat16)
    w = torch.zeros(2, 64, 64, device=device, dtype=torch.bfloat16).transpose(1, 2)
    try:
        torch._grouped_mm(x, w, offs=torch.tensor([16, 32], device=device, dtype=torch.int32))
    except Exception:  # noqa: BLE001 - a device torch's kernel cannot run on: its timed calls fail and drop it
        pass


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when torch._grouped_mm accepts its layout, else a contiguous copy.

    Its TMA path needs a 16-byte aligned base and one unit stride among the last two dims with the
    other a multiple of 16 bytes; sliced views and expanded gradients (``y.sum().backward()`` gives
    zero strides) do not qualify and would be rejected with "Invalid strides/sizes".
    """
    step = 16 // t.element_size()
    row, col = t.stride(-2), t.stride(-1)
    layout_ok = (col == 1 and row % step == 0 and row >= t.size(-1)) or (row == 1 and col % step == 0 and col >= t.size(-2))
    if t.data_ptr() % 16 == 0 and layout_ok:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def forward(x_TK, w_EKN, offsets_E, bias_EN=None, row_scale_T=None, out_dtype=None) -> torch.Tensor:
    out_dtype = out_dtype or x_TK.dtype
    acc_TN = torch._grouped_mm(_aligned(x_TK), _aligned(w_EKN), offs=offsets_E)
    return apply_epilogue(acc_TN, offsets_E, bias_EN, row_scale_T, out_dtype)


def dgrad(dy_TN, w_EKN, offsets_E, row_scale_T=None, out_dtype=None) -> torch.Tensor:
    out_dtype = out_dtype or dy_TN.dtype
    acc_TK = torch._grouped_mm(_aligned(dy_TN), _aligned(w_EKN).transpose(1, 2), offs=offsets_E)
    return apply_epilogue(acc_TK, offsets_E, None, row_scale_T, out_dtype)


def wgrad(x_TK, dy_TN, offsets_E, num_groups: int, out_dtype=None) -> torch.Tensor:
    """dw[e] = (dy_e^T @ x_e) as [E, N, K]; returned transposed as [E, K, N]."""
    out_dtype = out_dtype or x_TK.dtype
    dw_ENK = torch._grouped_mm(_aligned(dy_TN).t(), _aligned(x_TK), offs=offsets_E)
    if dw_ENK.dtype != out_dtype:
        dw_ENK = dw_ENK.to(out_dtype)
    return dw_ENK.transpose(1, 2)
