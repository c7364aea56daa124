"""``Quantizer``: the stateful object an op holds per GEMM operand (role).

Why objects and not just functions: DelayedScaling needs per-operand state (amax history, the
scale for the next step), and ops need to know which recipe settings a quantizer was built for
(``settings_key``) so that a changed recipe rebuilds quantizers instead of reusing stale ones.
A quantizer snapshots the recipe's settings at construction; it never reads the recipe again.

Usage copies: ``quantizer(x, rowwise=True, columnwise=False)``. "rowwise" quantizes along x's
last dim (x is the left GEMM operand, or a weight used as ``x @ w.T``); "columnwise" along x's
second-to-last dim (x's rows are the reduction dim: wgrad operands, or a right operand ``b[K, N]``).
Per-tensor formats hold one copy that serves both (``Float8Tensor.transpose_data``).
"""

from __future__ import annotations

import weakref

from typing import Optional, Tuple

import torch

from ..recipe import Recipe
from .formats import check_input, check_role
from .tensors import QuantizedTensor

__all__ = ["Quantizer"]


class Quantizer:
    """Base class. Subclasses set ``recipe_type`` and implement ``_quantize``."""

    recipe_type: type = Recipe
    #: (rows, cols) multiples a copy's own layout [..., R, C] must have (C = quantized dim)
    block_shape: Tuple[int, int] = (1, 1)
    #: whether ``_quantize`` takes max |x| from the kernel that wrote x (.amax_hints), so producers compute it
    takes_amax_hint: bool = False

    def __init__(self, recipe: Recipe, role: str, *, group=None):
        if not isinstance(recipe, self.recipe_type):
            raise TypeError(
                f"{type(self).__name__} needs a {self.recipe_type.__name__} recipe, got {type(recipe).__name__}"
            )
        self.role = check_role(role)
        self.settings_key = str(recipe)
        self.recipe_type_name = type(recipe).__name__
        # Weakly held: the caller owns the group. A quantizer caught in a reference cycle would
        # otherwise keep a gloo group alive until interpreter shutdown, where destroying it aborts
        # the process ("terminate called without an active exception"; seen in 2 of 10 loaded runs).
        self._group_ref = None if group is None else weakref.ref(group)
        self.rowwise = True
        self.columnwise = False

    @property
    def group(self):
        """The process group amax is reduced over (None: no reduction, or the group is gone)."""
        return None if self._group_ref is None else self._group_ref()

    # ------------------------------------------------------------------ configuration
    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        """Default copies produced by ``__call__`` (block formats); at least one must stay on."""
        new_rowwise = self.rowwise if rowwise is None else bool(rowwise)
        new_columnwise = self.columnwise if columnwise is None else bool(columnwise)
        if not (new_rowwise or new_columnwise):
            raise ValueError("set_usage: at least one of rowwise / columnwise must be True")
        self.rowwise, self.columnwise = new_rowwise, new_columnwise

    @property
    def wants_rht(self) -> bool:
        """True when this role's wgrad copy is Hadamard-transformed (NVFP4 input / grad_output)."""
        return False

    # ------------------------------------------------------------------ quantize
    def __call__(
        self,
        x: torch.Tensor,
        *,
        rowwise: Optional[bool] = None,
        columnwise: Optional[bool] = None,
        hadamard: Optional[bool] = None,
    ) -> QuantizedTensor:
        """Quantize x (not differentiable; see ``fake_quantize`` for a straight-through version).

        ``hadamard``: None = the role's default (NVFP4: RHT on the columnwise copy of input and
        grad_output when enabled); True/False forces it for every copy produced.
        """
        check_input(x)
        rowwise = self.rowwise if rowwise is None else bool(rowwise)
        columnwise = self.columnwise if columnwise is None else bool(columnwise)
        if not (rowwise or columnwise):
            raise ValueError("quantize: at least one of rowwise / columnwise must be True")
        if columnwise and x.dim() < 2:
            raise ValueError(f"a columnwise copy needs at least 2 dims, got shape {tuple(x.shape)}")
        self._check_tiling(x, rowwise, columnwise)
        with torch.no_grad():
            return self._quantize(x.detach(), rowwise, columnwise, hadamard)

    def _quantize(self, x, rowwise: bool, columnwise: bool, hadamard: Optional[bool]) -> QuantizedTensor:
        raise NotImplementedError

    def gathered(self, source: torch.Tensor, index: torch.Tensor, zero_rows: Optional[torch.Tensor] = None, *,
                 rowwise: bool = True, columnwise: bool = False, covers_source: bool = False) -> QuantizedTensor:
        """The quantization of rows ``index`` of a 2-D ``source`` (rows ``zero_rows`` of the result zero),
        without the gathered bf16 copy where the format allows: per-tensor scales quantize the source and
        gather FP8 bytes when ``covers_source`` (every source row gathered: the same amax); 1x128 FP8
        blocks read the rows through the index in their one cast pass. Same values as quantizing the
        copy, bit for bit; this base version makes the copy.

        Why: the MoE expert GEMMs read token rows gathered K times (te_dist.ops.RowGather), and the
        gathered copy is a write and a read of T*K bf16 rows that no GEMM needs."""
        check_input(source)
        if source.dim() != 2 or index.dim() != 1:
            raise ValueError(f"gathered() takes a 2-D source and a 1-D index, got shapes {tuple(source.shape)} "
                             f"and {tuple(index.shape)}")
        if not (rowwise or columnwise):
            raise ValueError("quantize: at least one of rowwise / columnwise must be True")
        self._check_tiling_shape((index.shape[0], source.shape[1]), rowwise, columnwise)
        with torch.no_grad():
            out = self._gathered(source.detach(), index, zero_rows, rowwise, columnwise, covers_source)
            if out is None:
                rows = source.detach().index_select(0, index)
                if zero_rows is not None:
                    rows.index_fill_(0, zero_rows, 0)
                out = self._quantize(rows, rowwise, columnwise, None)
            return out

    def _gathered(self, source, index, zero_rows, rowwise: bool, columnwise: bool,
                  covers_source: bool) -> Optional[QuantizedTensor]:
        """A subclass's way around the gathered copy (None: make the copy)."""
        return None

    # ------------------------------------------------------------------ tiling
    def _check_tiling(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> None:
        """Block formats tile exactly: say which dim needs which multiple (never pad silently)."""
        self._check_tiling_shape(tuple(x.shape), rowwise, columnwise)

    def _check_tiling_shape(self, shape: tuple, rowwise: bool, columnwise: bool) -> None:
        br, bc = self.block_shape
        if (br, bc) == (1, 1):
            return
        given = shape
        shape = shape if len(shape) >= 2 else (1, *shape)
        rows, cols = shape[-2], shape[-1]
        needs = []
        if rowwise:
            needs += [("last", cols, bc), ("second-to-last", rows, br)]
        if columnwise:
            needs += [("second-to-last", rows, bc), ("last", cols, br)]
        for name, size, multiple in needs:
            if size % multiple:
                raise ValueError(
                    f"{self.recipe_type_name} ({self.role}, {br}x{bc} blocks) cannot tile shape {tuple(given)}: "
                    f"the {name} dim is {size}, not a multiple of {multiple}; pad it to "
                    f"{-(-size // multiple) * multiple} (zeros do not change block scales)"
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role!r}, settings_key={self.settings_key!r})"
