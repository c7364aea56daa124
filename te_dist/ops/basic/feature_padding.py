"""Expert features off the FP8 kernels' 128 grid, zero padded to it inside GroupedLinear.

Legend: T rows, E experts, K in_features, N out_features, Kp / Np the next multiples of 128.

The block-scaled grouped kernels tile K and N by 128 (the scale block, ``te_dist.gemm.decide``); so do
the per-tensor ones unless ``te_dist.settings.fp8_unpadded_tensor_scales`` lets them take K and N of
16-byte rows as they are. A layer whose K or N is off that grid (gpt-oss's hidden 2880) runs the same
kernels on the zero-padded problem while ``te_dist.settings.fp8_pad_off_grid`` is on:

| operand | padded | result sliced back |
|---|---|---|
| weight copy | [E, N, K] -> [E, Np, Kp], once per cast | wgrad [E, Np, Kp] -> [E, N, K] |
| input x | [T, K] -> [T, Kp], before its quantize pass | dgrad [T, Kp] -> [T, K] |
| output gradient dy | [T, N] -> [T, Np], before its quantize pass | output [T, Np] -> [T, N] |
| bias | [E, N] -> [E, Np] | its gradient is formed from the unpadded dy |

Why zeros are exact: a zero changes neither a per-tensor amax nor a 1x128 / 128x128 block's amax, so
every real element gets the scale and FP8 value an exact tiling gives, and the padded products add
zeros only to the rows and columns that are sliced away. Slices are made contiguous: the ops after
the GEMM (SwiGLU, the combine, the optimizer) take the same layout as on the grid.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ... import settings

__all__ = ["GRID", "FeaturePadding", "zero_padded"]

GRID = 128  # the FP8 grouped kernels' tile of K and N (their scale block)


def zero_padded(t: torch.Tensor, pad_cols: int, pad_rows: int = 0) -> torch.Tensor:
    """``t`` with ``pad_cols`` zero columns (last dim) and ``pad_rows`` zero rows (the dim before). With
    ``te_dist.settings.fp8_pad_lean_copies`` each byte is written once: the values copied, only the
    margins zeroed (F.pad zero-fills the whole output, then copies the values over it)."""
    if not settings.current().fp8_pad_lean_copies:
        return F.pad(t, (0, pad_cols, 0, pad_rows) if pad_rows else (0, pad_cols))
    *lead, rows, cols = t.shape
    out = t.new_empty(*lead, rows + pad_rows, cols + pad_cols)
    out[..., :rows, :cols].copy_(t)
    out[..., :rows, cols:].zero_()
    out[..., rows:, :].zero_()
    return out


class FeaturePadding(NamedTuple):
    """The zero columns (``pad_k``) and rows (``pad_n``) that bring an ``[E, N, K]`` weight to the grid."""

    in_features: int
    out_features: int
    pad_k: int
    pad_n: int

    @classmethod
    def to_grid(cls, in_features: int, out_features: int) -> Optional["FeaturePadding"]:
        """The padding of a layer of these features, or None when both are on the grid already."""
        pad_k, pad_n = -in_features % GRID, -out_features % GRID
        if not (pad_k or pad_n):
            return None
        return cls(in_features, out_features, pad_k, pad_n)

    # ------------------------------------------------------------------ forward operands
    def weight(self, w_ENK: torch.Tensor) -> torch.Tensor:
        return zero_padded(w_ENK, self.pad_k, self.pad_n) if self.pad_k or self.pad_n else w_ENK

    def input(self, x_TK: torch.Tensor) -> torch.Tensor:
        return zero_padded(x_TK, self.pad_k) if self.pad_k else x_TK

    def bias(self, b_EN: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return F.pad(b_EN, (0, self.pad_n)) if self.pad_n and b_EN is not None else b_EN

    def output(self, y_TNp: torch.Tensor) -> torch.Tensor:
        return y_TNp[:, : self.out_features].contiguous() if self.pad_n else y_TNp

    # ------------------------------------------------------------------ backward operands
    def output_grad(self, dy_TN: torch.Tensor) -> torch.Tensor:
        return zero_padded(dy_TN, self.pad_n) if self.pad_n else dy_TN

    def input_grad(self, dx_TKp: torch.Tensor) -> torch.Tensor:
        return dx_TKp[:, : self.in_features].contiguous() if self.pad_k else dx_TKp

    def weight_grad(self, dw_ENpKp: torch.Tensor) -> torch.Tensor:
        """The gradient of the weight's shape [E, N, K]: a contiguous copy, or with
        ``settings.fp8_pad_lean_copies`` a view (autograd copies it into ``.grad`` at the first
        accumulation and adds it in place at the next: one copy per step, not one per micro-batch)."""
        view = dw_ENpKp[:, : self.out_features, : self.in_features]
        return view if settings.current().fp8_pad_lean_copies else view.contiguous()
