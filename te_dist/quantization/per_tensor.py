"""Per-tensor FP8 quantizers: DelayedScaling (amax history) and Float8CurrentScaling.

DelayedScaling, one call ``q = quantizer(x)``:
  1. quantize x with the *current* ``scale`` (derived from past amaxes; 1.0 before any update),
  2. record ``amax(x)``: all-reduce MAX over ``group`` when ``reduce_amax`` and the group has
     more than one rank, then roll it into ``amax_history`` (index 0 = most recent),
  3. recompute ``scale = fp8_max / A / 2**margin`` with ``A`` = max(history) ("max"),
     history[0] ("most_recent") or ``algo(history)`` for a callable (1-D float32 tensor, most
     recent first, returns a 0-dim amax). A zero or non-finite ``A`` keeps the previous scale.
New tensors are assigned only after every step succeeded, so an error leaves the state intact.

On CUDA the casts run as fused Triton kernels when available (see :mod:`.fused`): DelayedScaling
casts and records amax in one pass, then one tiny kernel updates history and scale; current
scaling runs an amax pass (none where the kernel that wrote x told its amax: :mod:`.amax_hints`)
and a cast pass that derives the scale on the device. Asked for the columnwise usage of x
[..., R, C] (R % 4 == 0), the cast pass also writes the transposed data (``data_t``: each matrix
transposed; an activation's wgrad operand, a weight's dgrad operand) from the same read.
"""

from __future__ import annotations

import torch

from ..recipe import DelayedScaling, Float8CurrentScaling
from . import amax_hints
from .cast import cast_fp8_per_tensor, current_scaling_quantize, delayed_scale_update, delayed_scaling_step
from .compile import dispatch
from .formats import FP8_MAX, format_for_role, fp8_dtype
from .fused import fused_casts_for, run_fused
from .quantizer import Quantizer
from .scaling import compute_amax, per_tensor_scale
from .tensors import Float8Tensor

__all__ = ["DelayedScalingQuantizer", "CurrentScalingQuantizer", "reduce_amax"]


def reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """MAX all-reduce of a 0-dim amax over ``group``; a no-op without a group or with one rank."""
    if group is None:
        return amax
    import torch.distributed as dist  # lazy: only distributed runs pay for it

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("an amax reduction group was given but torch.distributed is not initialized")
    if dist.get_world_size(group) <= 1:
        return amax
    buf = amax.detach().reshape(1).clone()
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    return buf.reshape(())


class _PerTensorQuantizer(Quantizer):
    """One scale for the whole tensor."""

    def _gathered(self, source, index, zero_rows, rowwise, columnwise, covers_source):
        """Quantize the source, then gather its FP8 bytes: the same operand as quantizing the gathered
        rows when every source row is gathered (the same amax)."""
        if not covers_source:
            return None
        q = self._quantize(source, True, False, None).take_rows(index, zero_rows, transposed=columnwise)
        return q if rowwise else q.wgrad_copy()


class DelayedScalingQuantizer(_PerTensorQuantizer):
    recipe_type = DelayedScaling

    def __init__(self, recipe: DelayedScaling, role: str, *, group=None):
        super().__init__(recipe, role, group=group)
        self.fmt = format_for_role(recipe.fp8_format, role)
        self.fp8_dtype = fp8_dtype(self.fmt)
        self.fmt_max = FP8_MAX[self.fmt]
        self.margin = recipe.margin
        self.amax_history_len = recipe.amax_history_len
        self.amax_compute_algo = recipe.amax_compute_algo
        self.reduce_amax = recipe.reduce_amax
        self.num_updates = 0
        self.amax_history = torch.zeros(self.amax_history_len, dtype=torch.float32)
        self.scale = torch.ones((), dtype=torch.float32)
        self.scale_inv = torch.ones((), dtype=torch.float32)

    def _to_device(self, device: torch.device) -> None:
        if self.scale.device != device:
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)
            self.scale_inv = self.scale_inv.to(device)

    def _fusable(self) -> bool:
        """Cast and update run as one compiled function unless a collective or a callable sits between."""
        needs_reduction = self.reduce_amax and self.group is not None
        return not needs_reduction and self.amax_compute_algo in ("max", "most_recent")

    def _quantize(self, x, rowwise, columnwise, hadamard):
        self._to_device(x.device)
        kernels = fused_casts_for(x)
        if self._fusable():
            args = (x, self.scale, self.amax_history, self.fp8_dtype, self.fmt_max, self.margin, self.amax_compute_algo)
            if kernels is not None and columnwise and x.dim() >= 2:  # the transposed data from the same pass
                key = ("delayed_scaling_step_rowcol", x.dtype, self.fp8_dtype, self.amax_compute_algo)
                result = run_fused(key, fused_casts_for(x, "rowcol").delayed_scaling_step_rowcol, *args)
                if result is not None:
                    data, data_t, history, scale, scale_inv = result
                    out = Float8Tensor(data, self.scale_inv, self.fmt, x.dtype, data_t=data_t)
                    self.amax_history, self.scale, self.scale_inv = history, scale, scale_inv
                    self.num_updates += 1
                    return out
            result = None
            if kernels is not None:
                key = ("delayed_scaling_step", x.dtype, self.fp8_dtype, self.amax_compute_algo)
                result = run_fused(key, kernels.delayed_scaling_step, *args)
            if result is None:
                result = dispatch(delayed_scaling_step, *args)
            data, history, scale, scale_inv = result
            out = Float8Tensor(data, self.scale_inv, self.fmt, x.dtype)
            self.amax_history, self.scale, self.scale_inv = history, scale, scale_inv
            self.num_updates += 1
            return out
        result = None
        if kernels is not None:  # one pass: cast with the current scale and record amax(x)
            key = ("cast_and_amax", x.dtype, self.fp8_dtype)
            result = run_fused(key, kernels.cast_and_amax, x, self.scale, self.fp8_dtype, self.fmt_max)
        if result is None:
            result = dispatch(cast_fp8_per_tensor, x, self.scale, self.fp8_dtype, self.fmt_max), compute_amax(x)
        data, amax = result
        out = Float8Tensor(data, self.scale_inv, self.fmt, x.dtype)
        self.update(amax)
        return out

    def observe(self, x: torch.Tensor) -> None:
        """Record x's amax and update the scale without quantizing (warm start, calibration)."""
        self._to_device(x.device)
        self.update(compute_amax(x.detach()))

    def _history_amax(self, history: torch.Tensor) -> torch.Tensor:
        algo = self.amax_compute_algo
        if algo == "max":
            return history.amax()
        if algo == "most_recent":
            return history[0]
        result = algo(history)
        if not isinstance(result, torch.Tensor) or result.numel() != 1:
            raise TypeError(
                f"amax_compute_algo callable must return a 1-element tensor, got {type(result).__name__} "
                f"{getattr(result, 'shape', '')}"
            )
        return result.reshape(()).to(torch.float32)

    def update(self, amax: torch.Tensor) -> None:
        """Roll ``amax`` into the history and recompute the scale (step 2-3 of the module docstring)."""
        amax = amax.to(device=self.amax_history.device, dtype=torch.float32).reshape(())
        if self.reduce_amax:
            amax = reduce_amax(amax, self.group)
        if self.amax_compute_algo in ("max", "most_recent"):
            history, scale, scale_inv = delayed_scale_update(
                amax, self.amax_history, self.scale, self.fmt_max, self.margin, self.amax_compute_algo
            )
        else:
            history = torch.cat((amax.reshape(1), self.amax_history[:-1]))
            scale = per_tensor_scale(self._history_amax(history), self.fmt_max, margin=self.margin, fallback=self.scale)
            scale_inv = 1.0 / scale
        self.amax_history, self.scale, self.scale_inv = history, scale, scale_inv
        self.num_updates += 1


class CurrentScalingQuantizer(_PerTensorQuantizer):
    """Scale from this tensor's own amax (all-reduced MAX over ``group`` when one is given)."""

    recipe_type = Float8CurrentScaling
    takes_amax_hint = True

    def __init__(self, recipe: Float8CurrentScaling, role: str, *, group=None):
        super().__init__(recipe, role, group=group)
        self.fmt = format_for_role(recipe.fp8_format, role)
        self.fp8_dtype = fp8_dtype(self.fmt)
        self.fmt_max = FP8_MAX[self.fmt]
        self.use_power_2_scales = recipe.use_power_2_scales

    def _quantize(self, x, rowwise, columnwise, hadamard):
        kernels = fused_casts_for(x)
        key = (x.dtype, self.fp8_dtype, self.use_power_2_scales)
        # the casts that also write the transposed data (te_dist.quantization.triton_rowcol)
        rowcol = fused_casts_for(x, "rowcol") if kernels is not None and columnwise and x.dim() >= 2 else None
        hinted = amax_hints.take(x)  # max |x| from the kernel that wrote x: no amax pass
        if self.group is None and hinted is None:
            result = None
            if rowcol is not None:
                result = run_fused(("current_scaling_quantize_rowcol", *key), rowcol.current_scaling_quantize_rowcol,
                                   x, self.fp8_dtype, self.fmt_max, self.use_power_2_scales)
                if result is not None:
                    data, data_t, scale_inv = result
                    return Float8Tensor(data, scale_inv, self.fmt, x.dtype, data_t=data_t)
            if kernels is not None:
                result = run_fused(
                    ("current_scaling_quantize", *key), kernels.current_scaling_quantize, x, self.fp8_dtype,
                    self.fmt_max, self.use_power_2_scales,
                )
            if result is None:
                result = dispatch(current_scaling_quantize, x, self.fp8_dtype, self.fmt_max, self.use_power_2_scales)
            data, scale_inv = result
            return Float8Tensor(data, scale_inv, self.fmt, x.dtype)
        amax = hinted
        if amax is None and kernels is not None:
            amax = run_fused(("compute_amax", x.dtype), kernels.compute_amax, x)
        amax = reduce_amax(compute_amax(x) if amax is None else amax, self.group)
        result = None
        if rowcol is not None:
            result = run_fused(("cast_from_amax_rowcol", *key), rowcol.cast_from_amax_rowcol, x, amax, self.fp8_dtype,
                               self.fmt_max, self.use_power_2_scales)
            if result is not None:
                data, data_t, scale_inv = result
                return Float8Tensor(data, scale_inv, self.fmt, x.dtype, data_t=data_t)
        if kernels is not None:  # the scale is derived from the reduced amax inside the cast kernel
            result = run_fused(
                ("cast_from_amax", *key), kernels.cast_from_amax, x, amax, self.fp8_dtype, self.fmt_max,
                self.use_power_2_scales,
            )
        if result is None:
            scale = per_tensor_scale(amax, self.fmt_max, power_2=self.use_power_2_scales)
            result = dispatch(cast_fp8_per_tensor, x, scale, self.fp8_dtype, self.fmt_max), 1.0 / scale
        data, scale_inv = result
        return Float8Tensor(data, scale_inv, self.fmt, x.dtype)
