"""RowGather: the rows of a grouped GEMM named as rows of a source tensor instead of copied out.

Row i of the GEMM's rows is ``source[index[i]]``; the rows in ``zero_rows`` are zero (the padding
rows that put each expert's first row on a block boundary). Its adjoint, :attr:`RowGather.sum_back`,
sums each source row's copies back into a tensor of the source's rows. A GroupedLinear handed one
in its :class:`~te_dist.ops.basic.grouped_linear.GroupSplits` takes it either way:
``rows_in``: its input is the source and the GEMM reads the gathered rows; ``rows_out``: its output
is the GEMM's rows summed back (the MoE combine at EP size 1: each token's K expert outputs), so its
output gradient is the source-shaped one and the GEMM's is its gather.

Why: on the native FP8 path the GEMM reads quantized rows, and the quantizer can make them without
the gathered bf16 copy (``Quantizer.gathered``): under a per-tensor recipe quantizing the source and
then gathering its bytes is the same operand whenever every source row is gathered at least once
(``covers_source``: the amax is the same); 1x128 blocks cast through the index. The MoE layer at EP
size 1 gathers each token K times (top-k), so the T*K bf16 rows are never written, for its first
GEMM's input and its second GEMM's output gradient (docs/moe.md "FP8 rows at EP size 1"). Other
paths take the rows as a copy (:meth:`take`), the same gather as before.

``sum_back`` is the caller's (a fixed-order sum over each source row's copies: te_dist.moe.permutation
builds it for the token expand); it is also the gradient of the gather.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

__all__ = ["RowGather"]


class RowGather(NamedTuple):
    index: torch.Tensor  # int64 [N]: the source row of each GEMM row
    zero_rows: Optional[torch.Tensor]  # int64: GEMM rows that are zero (padding), or None
    sum_back: Callable[[torch.Tensor], torch.Tensor]  # [N, ...] -> [source rows, ...]: each row's copies summed
    covers_source: bool  # every source row is gathered at least once

    @property
    def num_rows(self) -> int:
        return self.index.shape[0]

    def take(self, source: torch.Tensor) -> torch.Tensor:
        """The gathered rows as a copy (no autograd: ``backward`` is the gradient's way back)."""
        rows = source.index_select(0, self.index)
        return rows if self.zero_rows is None else rows.index_fill_(0, self.zero_rows, 0)
