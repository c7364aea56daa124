"""Unfused epilogue pieces (row scale, per-expert bias, bias gradient) in plain torch.

Used by the torch._grouped_mm and loop backends, and by autograd for dbias. Everything here is built from offsets ON
their device (searchsorted / index_add_), so it never syncs the host and is CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["group_ids", "apply_epilogue", "bias_grad"]


def group_ids(offsets_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Expert index of each row [T] (int64): the number of end offsets <= row."""
    rows = torch.arange(num_rows, device=offsets_E.device, dtype=torch.int32)
    return torch.searchsorted(offsets_E, rows, right=True)


def apply_epilogue(acc_TN: torch.Tensor, offsets_E: torch.Tensor, bias_EN: Optional[torch.Tensor],
                   row_scale_T: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """out = row_scale[:, None] * acc + bias[expert(row)], computed in fp32, cast to out_dtype.

    ``acc_TN`` is the caller's fresh GEMM accumulator and is consumed: a float32 one is updated in
    place (same values as out-of-place, one allocation less per call)."""
    if bias_EN is None and row_scale_T is None:
        return acc_TN if acc_TN.dtype == out_dtype else acc_TN.to(out_dtype)
    if bias_EN is None and acc_TN.dtype == out_dtype:
        # Row scale alone: one pass, in place; the product is computed in float32 (type promotion,
        # or bf16's float opmath) and rounded once into acc's dtype.
        return acc_TN.mul_(row_scale_T.unsqueeze(1))
    out = acc_TN.float()  # acc_TN itself when already float32
    if row_scale_T is not None:
        out.mul_((row_scale_T if row_scale_T.dtype == torch.float32 else row_scale_T.float()).unsqueeze(1))
    if bias_EN is not None:
        gid_T = group_ids(offsets_E, acc_TN.shape[0]).clamp_(max=bias_EN.shape[0] - 1)
        out.add_(bias_EN.float().index_select(0, gid_T))
    return out if out.dtype == out_dtype else out.to(out_dtype)


def bias_grad(dy_TN: torch.Tensor, offsets_E: torch.Tensor, num_groups: int, dtype: torch.dtype) -> torch.Tensor:
    """dbias[e] = sum of dy over the rows of expert e (zero for experts without rows)."""
    gid_T = group_ids(offsets_E, dy_TN.shape[0]).clamp_(max=max(num_groups - 1, 0))
    db = torch.zeros(num_groups, dy_TN.shape[1], device=dy_TN.device, dtype=torch.float32)
    db.index_add_(0, gid_T, dy_TN.float())
    return db.to(dtype)
