"""Block-scaled quantizers: Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling.

All three quantize a copy along its own last dim (see :mod:`.tensors` for the layouts) and are
stateless apart from the NVFP4 stochastic-rounding generator. Shapes must tile exactly; the
error names the dim and the multiple to pad to.

Block shapes per role:
  Float8BlockScaling: ``*_block_scaling_dim`` 1 -> 1x128, 2 -> 128x128 (input: x_, weight: w_,
  grad_output: grad_); scales float32, rounded down to powers of two with ``use_power_2_scales``.
  MXFP8BlockScaling: 1x32, E8M0 shared exponent (OCP MX rule, see ``scaling.mx_shared_exponent``),
  ``margin`` raises the exponent (more headroom, like DelayedScaling's margin).
  NVFP4BlockScaling: 1x16, or 16x16 for weights unless ``disable_2d_quantization``; the columnwise
  (wgrad) copy of input and grad_output is Hadamard-transformed unless ``disable_rht``; grad_output
  is stochastically rounded unless ``disable_stochastic_rounding``.

On CUDA, Float8BlockScaling and MXFP8 build both copies in one fused Triton pass when available
(a tile of x yields its row blocks and its transposed column blocks; see :mod:`.fused`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..recipe import Float8BlockScaling, Format, MXFP8BlockScaling, NVFP4BlockScaling, QParams
from .cast import cast_fp8_blocks, cast_mxfp8, cast_nvfp4
from .compile import dispatch
from .formats import FP8_EMAX, FP8_MAX, format_for_role, fp8_dtype
from .fused import fused_casts_for, run_fused
from .hadamard import apply_rht
from .quantizer import Quantizer
from .scaling import compute_amax, nvfp4_global_scale
from .tensors import BlockScaledData, Float8BlockTensor, MXFP8Tensor, NVFP4Tensor

__all__ = ["Float8BlockQuantizer", "MXFP8Quantizer", "NVFP4Quantizer"]


def _as_matrix(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() >= 2 else x.reshape(1, -1)


class _BlockQuantizer(Quantizer):
    """Shared driver: build the requested copies, each through ``_cast_copy``."""

    tensor_type = None

    def _quantize(self, x, rowwise, columnwise, hadamard):
        x2 = _as_matrix(x)
        copies = self._fused_copies(x2, rowwise, columnwise, hadamard) or {}
        if rowwise and "rowwise" not in copies:
            copies["rowwise"] = self._cast_copy(x2, transposed=False, hadamard=bool(hadamard))
        if columnwise and "columnwise" not in copies:
            rht = self.wants_rht if hadamard is None else bool(hadamard)
            copies["columnwise"] = self._cast_copy(x2.transpose(-1, -2), transposed=True, hadamard=rht)
        return self._make_tensor(x, copies)

    def _make_tensor(self, x, copies):
        return self.tensor_type(x.shape, x.dtype, self.fmt, copies.get("rowwise"), copies.get("columnwise"))

    def _cast_copy(self, x_copy: torch.Tensor, transposed: bool, hadamard: bool) -> BlockScaledData:
        raise NotImplementedError

    def _fused_copies(self, x2: torch.Tensor, rowwise: bool, columnwise: bool, hadamard) -> Optional[dict]:
        """Copies made by a fused kernel ({"rowwise": ..., "columnwise": ...}; the missing ones, or all
        when None, go through ``_cast_copy``)."""
        return None

    def _copies_from(self, fused, rowwise: bool, columnwise: bool, wrap_scale=lambda s: s) -> Optional[dict]:
        """Fused (row_data, row_scale, col_data, col_scale) -> {"rowwise": ..., "columnwise": ...}."""
        if fused is None:
            return None
        row_data, row_scale, col_data, col_scale = fused
        br, bc = self.block_shape
        copies = {}
        if rowwise:
            copies["rowwise"] = BlockScaledData(row_data, wrap_scale(row_scale), br, bc, transposed=False)
        if columnwise:
            copies["columnwise"] = BlockScaledData(col_data, wrap_scale(col_scale), br, bc, transposed=True)
        return copies


class Float8BlockQuantizer(_BlockQuantizer):
    recipe_type = Float8BlockScaling
    tensor_type = Float8BlockTensor

    def __init__(self, recipe: Float8BlockScaling, role: str, *, group=None):
        super().__init__(recipe, role, group=group)
        self.fmt = format_for_role(recipe.fp8_format, role)
        self.fp8_dtype = fp8_dtype(self.fmt)
        self.fmt_max = FP8_MAX[self.fmt]
        self.use_power_2_scales = recipe.use_power_2_scales
        dim = {
            "input": recipe.x_block_scaling_dim,
            "weight": recipe.w_block_scaling_dim,
            "grad_output": recipe.grad_block_scaling_dim,
        }[role]
        self.block_shape = (1, 128) if dim == 1 else (128, 128)

    def _fused_copies(self, x2, rowwise, columnwise, hadamard):
        kernels = fused_casts_for(x2)
        if kernels is None:
            return None
        br, bc = self.block_shape
        # a 2-D activation's columnwise copy (a wgrad operand): its scales also in the wgrad kernel's layout
        scales_t = columnwise and (br, bc) == (1, 128) and x2.dim() == 2
        key = ("cast_fp8_blocks", x2.dtype, self.fp8_dtype, br, bc, self.use_power_2_scales, rowwise, columnwise)
        fused = run_fused(
            key, kernels.cast_fp8_blocks, x2, br, bc, self.fp8_dtype, self.fmt_max, self.use_power_2_scales,
            rowwise=rowwise, columnwise=columnwise, col_scales_t=scales_t,
        )
        if fused is None or not scales_t:
            return self._copies_from(fused, rowwise, columnwise)
        return self._copies_with_wgrad_scales(fused, rowwise)

    def _copies_with_wgrad_scales(self, fused, rowwise):
        """The copies of a 1x128 cast whose columnwise scales came M-major (the wgrad kernel's layout)."""
        row_data, row_scale, col_data, scale_t = fused
        br, bc = self.block_shape
        copies = self._copies_from((row_data, row_scale, None, None), rowwise, False)
        copies["columnwise"] = BlockScaledData(col_data, scale_t[:-1].t(), br, bc, transposed=True, scale_inv_t=scale_t)
        return copies

    def from_wgrad_cast(self, shape, dtype, fused, rowwise: bool = True) -> Float8BlockTensor:
        """The tensor of a 1x128 cast of a 2-D x made elsewhere: ``fused`` = (row data, row scales, columnwise
        data, its scales M-major [R/128 + 1, C]), as ``cast_fp8_blocks(col_scales_t=True)`` returns them (the
        gathered cast here; the LM head's gradient written by the loss, te_dist.train.head_loss)."""
        copies = self._copies_with_wgrad_scales(fused, rowwise)
        return self.tensor_type(shape, dtype, self.fmt, copies.get("rowwise"), copies["columnwise"])

    def _gathered(self, source, index, zero_rows, rowwise, columnwise, covers_source):
        """1x128 blocks with the columnwise copy: one tile-kernel pass reads the rows through the index."""
        kernels = fused_casts_for(source)
        if kernels is None or self.block_shape != (1, 128) or not columnwise:
            return None
        idx = index if zero_rows is None else index.index_fill(0, zero_rows, -1)  # -1: a zero row
        key = ("cast_fp8_blocks_gathered", source.dtype, self.fp8_dtype, self.use_power_2_scales, rowwise)
        fused = run_fused(key, kernels.cast_fp8_blocks, source, 1, 128, self.fp8_dtype, self.fmt_max,
                          self.use_power_2_scales, rowwise=rowwise, columnwise=True, col_scales_t=True, gather=idx)
        if fused is None:
            return None
        return self.from_wgrad_cast((index.shape[0], source.shape[1]), source.dtype, fused, rowwise)

    def _cast_copy(self, x_copy, transposed, hadamard):
        br, bc = self.block_shape
        data, scale_inv = dispatch(cast_fp8_blocks, x_copy, br, bc, self.fp8_dtype, self.fmt_max, self.use_power_2_scales)
        return BlockScaledData(data, scale_inv, br, bc, transposed=transposed)


class MXFP8Quantizer(_BlockQuantizer):
    recipe_type = MXFP8BlockScaling
    tensor_type = MXFP8Tensor
    block_shape = (1, 32)

    def __init__(self, recipe: MXFP8BlockScaling, role: str, *, group=None):
        super().__init__(recipe, role, group=group)
        self.fmt = format_for_role(recipe.fp8_format, role)
        self.fp8_dtype = fp8_dtype(self.fmt)
        self.fmt_max = FP8_MAX[self.fmt]
        self.emax_elem = FP8_EMAX[self.fmt]
        self.margin = recipe.margin

    def _fused_copies(self, x2, rowwise, columnwise, hadamard):
        kernels = fused_casts_for(x2)
        if kernels is None:
            return None
        key = ("cast_mxfp8", x2.dtype, self.fp8_dtype, self.margin, rowwise, columnwise)
        fused = run_fused(
            key, kernels.cast_mxfp8, x2, self.fp8_dtype, self.fmt_max, self.emax_elem, self.margin,
            rowwise=rowwise, columnwise=columnwise,
        )
        return self._copies_from(fused, rowwise, columnwise, lambda codes: codes.view(torch.float8_e8m0fnu))

    def _cast_copy(self, x_copy, transposed, hadamard):
        data, codes = dispatch(cast_mxfp8, x_copy, 32, self.fp8_dtype, self.fmt_max, self.emax_elem, self.margin)
        return BlockScaledData(data, codes.view(torch.float8_e8m0fnu), 1, 32, transposed=transposed)


class NVFP4Quantizer(_BlockQuantizer):
    """``generator``: optional torch.Generator (on the data's device) for stochastic rounding;
    without one the global RNG is used, so ``torch.manual_seed`` makes results reproducible (a
    compiled cast draws its noise inside the kernel: same distribution, different stream than eager)."""

    recipe_type = NVFP4BlockScaling
    tensor_type = NVFP4Tensor

    def __init__(self, recipe: NVFP4BlockScaling, role: str, *, group=None, generator: Optional[torch.Generator] = None):
        super().__init__(recipe, role, group=group)
        self.fmt = Format.E2M1
        self.qparams: QParams = {
            "input": recipe.fp4_quant_fwd_inp,
            "weight": recipe.fp4_quant_fwd_weight,
            "grad_output": recipe.fp4_quant_bwd_grad,
        }[role]
        self.block_shape = (16, 16) if self.qparams.fp4_2d_quantization else (1, 16)
        self.generator = generator

    @property
    def wants_rht(self) -> bool:
        return self.qparams.random_hadamard_transform

    @property
    def stochastic_rounding(self) -> bool:
        return self.qparams.stochastic_rounding

    def _fused_copies(self, x2, rowwise, columnwise, hadamard):
        """The rowwise copy from the fused kernel when it has no Hadamard transform and the noise of
        stochastic rounding may come from the global RNG (no own generator); the columnwise copy
        (the wgrad operand, usually Hadamard-transformed) stays on the compiled path."""
        if not rowwise or hadamard or (self.stochastic_rounding and self.generator is not None):
            return None
        kernels = fused_casts_for(x2, "nvfp4")
        if kernels is None:
            return None
        br, bc = self.block_shape
        key = ("cast_nvfp4", x2.dtype, br, self.stochastic_rounding)
        fused = run_fused(key, kernels.cast_nvfp4, x2, br, self.stochastic_rounding)
        if fused is None:
            return None
        packed, scale, global_scale_inv = fused
        return {"rowwise": BlockScaledData(packed, scale, br, bc, transposed=False, hadamard=False,
                                           global_scale_inv=global_scale_inv)}

    def _cast_copy(self, x_copy, transposed, hadamard):
        br, bc = self.block_shape
        if hadamard:
            x_copy = apply_rht(x_copy.to(torch.float32))
        # The tensor scale comes from the copy's own amax: a Hadamard transform can raise it up to 4x.
        s_enc = nvfp4_global_scale(compute_amax(x_copy))
        noise = None
        if self.stochastic_rounding and self.generator is not None:
            noise = torch.rand(x_copy.shape, device=x_copy.device, generator=self.generator)
        packed, scale = dispatch(cast_nvfp4, x_copy, br, bc, s_enc, noise, self.stochastic_rounding)
        return BlockScaledData(
            packed, scale, br, bc, transposed=transposed, hadamard=hadamard, global_scale_inv=1.0 / s_enc
        )
