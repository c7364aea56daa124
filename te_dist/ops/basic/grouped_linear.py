"""GroupedLinear: one linear layer per expert over contiguous row groups (``y_e = x_e @ W_e.T + b_e``).

Legend: T rows (tokens), E groups (experts), K in_features, N out_features.
The weight is stored ``[E, N, K]`` (like nn.Linear per expert); the GEMMs see it as a transposed
``[E, K, N]`` view. The extra input ``split_sizes`` (int tensor [E], on CPU or the data's device,
zeros allowed) becomes int32 cumulative END offsets on the data's device — computed on the device
when the split sizes already live there, so no host sync. CPU split sizes are validated (non-negative,
summing to T) before any kernel runs, and are also handed to the GEMMs as host ints
(``group_sizes``): the backend then sees the actual group sizes, and cuBLAS per expert may run
where it beats the grouped kernels (te_dist.gemm.decide), without reading the offsets.
A caller that holds both forms passes a :class:`GroupSplits` (the MoE dispatcher, see there); it may
name the GEMM's rows as a :class:`~te_dist.ops.basic.row_gather.RowGather` of another tensor's rows:
``rows_in`` (the op's input is the gather's source) or ``rows_out`` (the op's output is the GEMM's rows
summed back into the source's rows).

``grouped_forward`` / ``grouped_backward`` are the functional core the grouped-MLP fused op calls.
The saved input may carry a per-row scale (``input = x * row_scale[:, None]``) so the fused op can
use grouped_mm's row-scale epilogue without materialising the scaled activation.

Under an FP8 recipe each forward asks the support predicate (``is_module_grouped_tensor_supported``
here, the op-fuser one when the grouped-MLP fusion runs) with the input's dtype and device and
the split alignment the host sizes guarantee. Yes: the native path - x quantized once in both
layouts its GEMMs read, the weight quantized in both layouts at every forward unless the caller says
the weights did not change since the last cast (``is_first_microbatch``: see :mod:`.weight_copy`),
the FP8 copies saved for backward, the three GEMMs on the quantized grouped entry points of
``te_dist.kernels``. No: the emulated path (fake-quantize, then
the bf16 GEMM), which is also the reference and the path of every ``backward_override``.
Features off the kernels' 128 grid take the native path zero padded to it
(:mod:`.feature_padding`) while ``te_dist.settings.fp8_pad_off_grid`` is on; off, the emulated path.
Under the per-tensor recipes features on a multiple of 16 go unpadded
(``te_dist.settings.fp8_unpadded_tensor_scales``): their kernels have no 128-wide scale blocks.
With ``fuse_wgrad_accumulation`` set the native path adds its weight gradient into Megatron's ``main_grad`` or an
existing ``.grad`` itself (:mod:`.wgrad_accumulation`).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Optional

import torch

from ... import settings
from ...recipe import DelayedScaling, Float8CurrentScaling
from ..op import BasicOperation, OpContext
from . import wgrad_accumulation
from ._quant import GemmQuantizers, fake_quantize_or_identity
from .feature_padding import FeaturePadding
from .row_gather import RowGather
from .weight_copy import WeightCopy, check_microbatch_flag

__all__ = ["GroupedLinear", "GroupSplits", "split_sizes_to_groups", "host_split_alignment",
           "remember_split_alignment", "split_rows", "check_rows_out", "cast_weight_copy",
           "wgrad_copy"]

_kernels = None
_support = None
_TENSOR_SCALED = (DelayedScaling, Float8CurrentScaling)  # one scale per operand: no 128-wide scale blocks


def support():
    """te_dist.support, imported on first use."""
    global _support
    if _support is None:
        from ... import support as module

        _support = module
    return _support


def kernels():
    """te_dist.kernels, imported on first use (it is a leaf that may probe the GPU lazily)."""
    global _kernels
    if _kernels is None:
        from ... import kernels as module

        _kernels = module
    return _kernels


class GroupSplits(NamedTuple):
    """A row split given both ways: ``offsets``, int32 cumulative end rows [E] on the data's device,
    and ``sizes``, the rows of each group as host ints. ``rows_in``: the op's input is not the GEMM's
    rows but the source they are gathered from (a :class:`RowGather`); ``rows_out``: the op returns
    the GEMM's rows summed back into the source's rows (``rows_out.sum_back``). Each applies to the
    op it is handed to: the MoE layer gives fc1 ``rows_in`` and fc2 ``rows_out``.

    Why: the MoE dispatcher builds the offsets on the device before its one host read of the
    counts, and the read brings the sizes. Handing both over spares the op the host→device copy of
    CPU split sizes, which would be queued just after that read, while the GPU waits for work
    (docs/moe.md "The host read"). The two must agree: ``sizes`` are validated, ``offsets`` are
    never read (that would sync)."""

    offsets: torch.Tensor
    sizes: tuple
    rows_in: Optional[RowGather] = None
    rows_out: Optional[RowGather] = None


def _check_group_splits(splits: GroupSplits, num_groups: int, x: torch.Tensor, num_rows: Optional[int]):
    offsets, sizes, rows_in, rows_out = splits
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.shape != (num_groups,):
        got = f"{offsets.dtype} {tuple(offsets.shape)}" if isinstance(offsets, torch.Tensor) else type(offsets).__name__
        raise TypeError(f"GroupSplits.offsets must be an int32 tensor of shape [{num_groups}], got {got}")
    if offsets.device != x.device:
        raise ValueError(f"GroupSplits.offsets on {offsets.device} but the input is on {x.device}")
    sizes = tuple(sizes)
    if len(sizes) != num_groups:
        raise ValueError(f"GroupSplits.sizes must have {num_groups} entries (one per group), got {len(sizes)}")
    if rows_in is not None:
        _check_rows("rows_in", rows_in, x)
        num_rows = rows_in.num_rows
    _check_host_sizes(sizes, x.shape[0] if num_rows is None else num_rows, "GroupSplits.sizes")
    if rows_out is not None:
        check_rows_out(rows_out, sizes, x)
    return offsets, sizes


def check_rows_out(rows_out, sizes, x: torch.Tensor) -> None:
    """``rows_out`` is a RowGather of as many rows as the split (``sizes``) on x's device."""
    _check_rows("rows_out", rows_out, x)
    if sizes is not None and rows_out.num_rows != sum(sizes):
        raise ValueError(f"GroupSplits.rows_out gathers {rows_out.num_rows} rows but the split has {sum(sizes)}")


def _check_rows(name: str, rows, x: torch.Tensor) -> None:
    if not isinstance(rows, RowGather):
        raise TypeError(f"GroupSplits.{name} must be a RowGather or None, got {type(rows).__name__}")
    index = rows.index
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or index.dim() != 1:
        got = f"{index.dtype} {tuple(index.shape)}" if isinstance(index, torch.Tensor) else type(index).__name__
        raise TypeError(f"GroupSplits.{name}.index must be a 1-D int64 tensor, got {got}")
    if index.device != x.device:
        raise ValueError(f"GroupSplits.{name}.index on {index.device} but the input is on {x.device}")


def split_rows(split_sizes):
    """``(rows_in, rows_out)`` of a :class:`GroupSplits` (Nones for every other form of split sizes)."""
    if isinstance(split_sizes, GroupSplits):
        return split_sizes.rows_in, split_sizes.rows_out
    return None, None


_last_alignment = (None, None)  # (the last sizes tuple, its alignment): one entry, replaced whole
_said_emulated: set = set()  # (recipe type, reason) already warned about in this process


def host_split_alignment(group_sizes) -> Optional[int]:
    """The largest power of two up to 128 that divides every group size (so every group's first
    row), or None when the sizes are not on the host or all groups are empty. Powers of two keep the
    predicates' cache to a few entries whatever the sizes are.

    The MoE layer and both GEMMs of the fused MLP ask for the same sizes tuple in one step, so the
    last tuple's answer is kept (by identity: a tuple cannot change): the gcd of many sizes is the
    larger part of a routing decision (docs/benchmarks.md, "Support predicates")."""
    global _last_alignment
    if group_sizes is None:
        return None
    last = _last_alignment
    if last[0] is group_sizes:
        return last[1]
    g = math.gcd(*group_sizes)
    result = None if g == 0 else min(g & -g, 128)
    if isinstance(group_sizes, tuple):
        _last_alignment = (group_sizes, result)
    return result


def remember_split_alignment(group_sizes: tuple, bits_or: int) -> None:
    """Record the alignment of ``group_sizes`` from the OR of all its sizes (the lowest set bit of
    the OR is the largest power of two dividing every size), for a caller that built the sizes in a
    loop anyway (te_dist.moe.padding): the next ask for this tuple is a hit."""
    global _last_alignment
    _last_alignment = (group_sizes, None if bits_or == 0 else min(bits_or & -bits_or, 128))


def _check_host_sizes(sizes, num_rows: int, name: str) -> None:
    """Host split sizes (of either form) are non-negative and cover the input's rows."""
    if sizes and min(sizes) < 0:
        raise ValueError(f"{name} must be non-negative, got {sizes}")
    if sum(sizes) != num_rows:
        raise ValueError(f"{name} sum to {sum(sizes)} but the input has {num_rows} rows: {sizes}")


def split_sizes_to_groups(split_sizes, num_groups: int, x: torch.Tensor, num_rows: Optional[int] = None):
    """``(offsets, group_sizes)``: int32 cumulative end offsets [E] on ``x.device``, and the sizes as a
    tuple of host ints when they live on the host (else None: a device tensor is never read).
    CPU split sizes are validated, without a device sync; a :class:`GroupSplits` is taken as it is
    (its sizes validated against its ``rows_in``, else ``num_rows``, else x's row count)."""
    if isinstance(split_sizes, GroupSplits):
        return _check_group_splits(split_sizes, num_groups, x, num_rows)
    if isinstance(split_sizes, (list, tuple)):
        split_sizes = torch.tensor(split_sizes, dtype=torch.int64)
    if not isinstance(split_sizes, torch.Tensor):
        raise TypeError(f"split_sizes must be an int tensor of shape [{num_groups}], got {type(split_sizes).__name__}")
    if split_sizes.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"split_sizes must be int64 or int32, got {split_sizes.dtype}")
    if split_sizes.dim() != 1 or split_sizes.shape[0] != num_groups:
        raise ValueError(f"split_sizes must have shape [{num_groups}] (one per group), got {tuple(split_sizes.shape)}")
    if split_sizes.is_cpu:
        sizes = split_sizes.tolist()
        _check_host_sizes(sizes, x.shape[0] if num_rows is None else num_rows, "split_sizes")
        offsets = torch.cumsum(split_sizes, 0, dtype=torch.int32)
        if not x.is_cpu:
            # From pinned memory the copy is queued on the stream and the host moves on (no wait for the GPU).
            offsets = offsets.pin_memory().to(x.device, non_blocking=True)
        return offsets, tuple(sizes)
    if split_sizes.device != x.device:
        raise ValueError(f"split_sizes on {split_sizes.device} but the input is on {x.device}")
    return torch.cumsum(split_sizes, 0, dtype=torch.int32), None  # stays on the device: no sync


class GroupedLinear(BasicOperation):
    """``num_groups`` experts of ``in_features -> out_features``; extra input: ``split_sizes`` [E]."""

    num_extra_inputs = 1

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = False,
                 dtype=None, device=None):
        super().__init__()
        for name, value in (("num_groups", num_groups), ("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GroupedLinear {name} must be a positive int, got {name}={value!r}")
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.weight = torch.nn.Parameter(torch.empty(num_groups, out_features, in_features, device=device, dtype=dtype))
        bound = 1.0 / math.sqrt(in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(num_groups, out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self._quantizers = GemmQuantizers(None)
        self._weight_copy = WeightCopy()  # the native FP8 path's weight copy
        # None: cast the weight at every forward; True / False: TransformerEngine's micro-batch protocol
        self.is_first_microbatch = None
        self.fuse_wgrad_accumulation = False  # the native wgrad adds into main_grad / .grad (wgrad_accumulation)
        self._emulated_said_for = None  # (recipe key, device) whose emulated path this op has reported
        # the quantized grouped kernels tile both features by 128 (the scale block): None on the grid, else
        # the zero padding the native path adds (while te_dist.settings.fp8_pad_off_grid is on)
        self._padding = FeaturePadding.to_grid(in_features, out_features)

    def reset_recipe_state(self, recipe) -> None:
        self._quantizers = GemmQuantizers(recipe)
        self._weight_copy = WeightCopy()

    @property
    def quantizers(self) -> GemmQuantizers:
        return self._quantizers

    def groups(self, split_sizes, x: torch.Tensor, num_rows: Optional[int] = None):
        """``(offsets, group_sizes)`` of ``split_sizes`` for input ``x`` of ``num_rows`` GEMM rows (default:
        x's; see split_sizes_to_groups)."""
        return split_sizes_to_groups(split_sizes, self.num_groups, x, num_rows)

    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.in_features:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"GroupedLinear expects input [T, {self.in_features}], got {shape}")
        if x.dtype != self.weight.dtype:
            raise TypeError(f"GroupedLinear input dtype {x.dtype} does not match weight dtype {self.weight.dtype}")

    # ------------------------------------------------------------------ functional core
    @property
    def native_shape_ok(self) -> bool:
        """The quantized grouped kernels tile both features by 128 (the scale block): on the grid, or
        off it while ``te_dist.settings.fp8_pad_off_grid`` pads them (read at every ask, so an override
        takes effect at the next forward)."""
        return self._padding is None or settings.current().fp8_pad_off_grid

    def _native_padding(self) -> Optional[FeaturePadding]:
        """The zero padding of the native path: None on the grid, and for the per-tensor recipes under
        ``te_dist.settings.fp8_unpadded_tensor_scales`` wherever both features are multiples of 16 (their
        kernels take such K and N as they are; only block scales tile them by 128)."""
        pad = self._padding
        if pad is not None and settings.current().fp8_unpadded_tensor_scales and \
                isinstance(self._quantizers.recipe, _TENSOR_SCALED) and not (self.in_features | self.out_features) % 16:
            return None
        return pad

    def native_path(self, x: torch.Tensor, group_sizes, predicate=None) -> bool:
        """Does this call take the quantized grouped path? Asks the support predicate (the module
        one unless the caller passes another) with x's dtype and device and the host sizes' alignment.
        Only under a recipe whose backward quantizes too (no ``backward_override``) and on CUDA;
        elsewhere the emulated path is the reference."""
        q = self._quantizers
        if not q.active or q.backward_override is not None or not self.native_shape_ok:
            return False
        predicate = predicate or support().is_module_grouped_tensor_supported
        supported = predicate(q.recipe, x.dtype, split_alignment=host_split_alignment(group_sizes), device=x.device)
        return supported and x.is_cuda  # on CPU the grouped answer is the reference path

    def grouped_forward(self, ctx: OpContext, x, groups, *, row_scale: Optional[torch.Tensor] = None,
                        native: Optional[bool] = None, rows_in: Optional[RowGather] = None,
                        rows_out: Optional[RowGather] = None):
        """``y = row_scale * (x @ W_e.T) + b_e``; the op's input is ``x * row_scale`` (row_scale: fused use only).
        ``groups``: the ``(offsets, group_sizes)`` pair of :meth:`groups`, kept together for the backward.
        ``native``: the caller's predicate answer (the fused op asks once for both GEMMs); None asks here.
        ``rows_in``: the GEMM reads these rows of x (x is their source; its gradient is the source's);
        ``rows_out``: the result is the GEMM's rows summed back into the source's (see GroupSplits)."""
        y = self._forward_rows(ctx, x, groups, row_scale, native, rows_in, rows_out)
        if self.is_first_microbatch:  # the later micro-batches of this optimizer step reuse the copy
            self.is_first_microbatch = False
        return y if rows_out is None else rows_out.sum_back(y)

    def _forward_rows(self, ctx, x, groups, row_scale, native, rows_in, rows_out):
        """The GEMM's rows of :meth:`grouped_forward` (before ``rows_out`` sums them back)."""
        offsets, group_sizes = groups
        q = self._quantizers
        w = self.weight
        rows = (rows_in, rows_out)
        if rows_in is not None:
            if q.active and native is None:
                native = self.native_path(x, group_sizes)
            if native:  # the quantizer reads the rows through the index where it can (RowGather says why)
                return self._quantized_forward(ctx, x, groups, rows, x_is_source=True)
            x = rows_in.take(x)
        if not q.active:
            backend = None
            if x.device.type == "cuda" and not support().is_module_grouped_tensor_supported(
                    None, x.dtype, device=x.device):
                backend = "loop"  # no single-launch grouped kernel for this dtype or device: split path
            w_EKN = w.mT  # one view for the GEMM and the backward (.mT: 2/3 of transpose(1, 2)'s host time)
            y = kernels().grouped_mm_forward(x, w_EKN, offsets, bias_EN=self.bias, row_scale_T=row_scale,
                                             check_offsets=False, group_sizes=group_sizes, backend=backend)
            self._save(ctx, x, row_scale, w_EKN, groups, rows)
            return y
        assert row_scale is None, "quantized inputs must be scaled before quantization"
        if native is None:
            native = self.native_path(x, group_sizes)
        if native:
            return self._quantized_forward(ctx, x, groups, rows)
        if x.is_cuda and q.backward_override is None:
            self._say_emulated(x)
        xq = fake_quantize_or_identity(x, q.input)
        wq_EKN = fake_quantize_or_identity(w, q.weight).transpose(1, 2)
        y = kernels().grouped_mm_forward(
            xq, wq_EKN, offsets, bias_EN=self.bias, check_offsets=False, group_sizes=group_sizes
        )
        # The weight is saved as the [E, K, N] view the GEMMs take (dgrad uses it as is).
        saved_x, saved_w = (xq, wq_EKN) if q.save_quantized_operands else (x, w.transpose(1, 2))
        self._save(ctx, saved_x, None, saved_w, groups, rows)
        return y

    def _say_emulated(self, x) -> None:
        """Warn once per process and reason that an FP8 recipe runs the emulated path on a GPU (fake-quantize,
        then the bf16 GEMM: slower than bf16 alone), naming the path and why. Each op works the reason out
        once per recipe and device: every later emulated forward returns at the first line."""
        shape_ok = self.native_shape_ok  # the reason follows te_dist.settings.fp8_pad_off_grid
        said_for = (self._quantizers.settings_key, x.device, shape_ok)
        if self._emulated_said_for == said_for:
            return
        self._emulated_said_for = said_for
        recipe = self._quantizers.recipe
        if not shape_ok:
            why = (f"expert features {self.in_features} -> {self.out_features} are not multiples of 128, the FP8 "
                   "kernels' scale block (te_dist.settings.fp8_pad_off_grid pads them; it is off)")
        else:
            path, why = support().explain_path(recipe, x.dtype, device=x.device)
            if path == "native":  # the kernels run here, but not on these splits
                why = (f"the experts' row splits are not multiples of {support().native_split_alignment(recipe)} "
                       "rows (MoELayer pads them; a caller's own dispatcher must too)")
        key = (type(recipe).__name__, "features" if not shape_ok else why)
        if key not in _said_emulated:
            _said_emulated.add(key)
            warnings.warn(f"te_dist: {type(recipe).__name__} expert GEMMs on {x.device} run the emulated path "
                          f"(fake-quantize, then the bf16 GEMM; slower than bf16): {why}", stacklevel=2)

    def _save(self, ctx, x, row_scale, w, groups, rows=(None, None)) -> None:
        """``rows``: (rows_in, rows_out) of the forward (backward maps the gradients through them)."""
        if ctx.requires_grad:
            weight_rg = self.weight.requires_grad
            bias_rg = self.bias is not None and self.bias.requires_grad
            ctx.saved = (x if weight_rg else None, row_scale, w, groups, weight_rg, bias_rg, rows)

    def _quantized_forward(self, ctx, x, groups, rows=(None, None), *, x_is_source=False):
        """The native path: x quantized once (rowwise for fprop, columnwise for wgrad), the weight's
        copy reused while its version lasts; only the FP8 copies backward needs are saved.
        ``rows``: (rows_in, rows_out) of the forward; ``x_is_source``: x is rows_in's source and the
        quantizer casts the gathered rows (``Quantizer.gathered``), else x holds the GEMM's rows.
        Off the grid, x (or rows_in's source) and the bias are zero padded to the weight copy's [Kp] / [Np]
        and the output is sliced back to N (:mod:`.feature_padding`)."""
        offsets, group_sizes = groups
        q = self._quantizers
        pad = self._native_padding()
        bias = self.bias
        if pad is not None:
            x, bias = pad.input(x), pad.bias(bias)
        need_wgrad = ctx.requires_grad and self.weight.requires_grad
        if x_is_source:
            rows_in = rows[0]
            xq = q.input.gathered(x, rows_in.index, rows_in.zero_rows, rowwise=True, columnwise=need_wgrad,
                                  covers_source=rows_in.covers_source)
        else:
            xq = q.input(x, rowwise=True, columnwise=need_wgrad)
        wq = self.quantized_weight()
        y = kernels().grouped_mm_quantized_forward(xq, wq, offsets, bias_EN=bias, out_dtype=x.dtype,
                                                   group_sizes=group_sizes)
        self._save(ctx, wgrad_copy(xq) if need_wgrad else None, None, wq, groups, rows)
        return y if pad is None else pad.output(y)

    @property
    def has_native_weight_copy(self) -> bool:
        """True once the native quantized path cast this weight (so that path ran under the
        current recipe): what ``te-dist train`` reports after its first step."""
        return self._weight_copy.casts + self._weight_copy.offers_taken > 0

    def quantized_weight(self):
        """The weight quantized under the current recipe, in both GEMM layouts: cast anew unless
        ``is_first_microbatch`` is False and the copy kept by an earlier forward is still valid
        (:mod:`.weight_copy` says when)."""
        return self._weight_copy.get(*self._copy_request())

    def prepare_weight(self) -> None:
        """Queue now the cast :meth:`quantized_weight` would queue in the next forward, which then takes that
        copy (:meth:`.weight_copy.WeightCopy.prepare`): the MoE layer calls it while its dispatch's counts
        travel to the host, so the GPU casts while the host waits (docs/moe.md "The host read"). Nothing
        where the op is not on a quantized native-capable path (no recipe, a backward override, a shape off
        the kernels)."""
        q = self._quantizers
        if q.active and q.backward_override is None and self.native_shape_ok:
            self._weight_copy.prepare(*self._copy_request())

    def optimizer_copy_quantizer(self):
        """The weight quantizer an optimizer may cast this weight's copy with, in its update of the weight
        (``te_dist.optim.AdamWWithFP8Copies``), or None. Only where the next forward would take that copy as
        its own cast: the last forward took the native path under a caller driving ``is_first_microbatch`` (it
        kept a copy), and the recipe's copy (of the zero padded weight, where the native path pads it) can be cast
        in the update (``te_dist.quantization.optimizer_copy.writes_copy``)."""
        q = self._quantizers
        if not (self._weight_copy.kept and q.active and q.backward_override is None):
            return None
        from ...quantization.optimizer_copy import writes_copy  # ops import no quantization module up front

        return q.weight if writes_copy(q.weight, padded=self._native_padding() is not None) else None

    def offer_weight_copy(self, copy) -> None:
        """Hand the next forward the weight copy an optimizer wrote with its update (``WeightCopy.offer``)."""
        weight, key, _, _ = self._copy_request()
        self._weight_copy.offer(weight, key, kernels().prepare_quantized_weight(copy))

    def _copy_request(self):
        """``(weight, settings key, cast, is_first_microbatch)`` for the weight copy."""
        flag = check_microbatch_flag(self.is_first_microbatch)
        pad = self._native_padding()
        key = self._quantizers.settings_key if pad is self._padding else \
            f"{self._quantizers.settings_key}|unpadded"  # a kept copy is of one layout: padded or not
        return self.weight, key, lambda: self._cast_weight(pad), flag

    def _cast_weight(self, pad: Optional[FeaturePadding]):
        """The weight's FP8 copy; with ``pad`` of the zero-padded [E, Np, Kp] weight."""
        w = self.weight.detach()
        return cast_weight_copy(self._quantizers, w if pad is None else pad.weight(w))

    def grouped_backward(self, ctx: OpContext, dy):
        """Returns ``(dx, dweight, dbias)`` for the op's input ``x * row_scale`` (dy: the op's output gradient)."""
        if isinstance(ctx.saved[2], kernels().QuantizedWeight):
            return self._quantized_backward(ctx, dy)
        dy = self.gemm_output_grad(ctx, dy)
        dyq = fake_quantize_or_identity(dy, self._quantizers.grad_output)
        dx = self.grouped_dgrad(ctx, dyq)
        saved_x, row_scale = ctx.saved[0], ctx.saved[1]
        x_in = saved_x
        if saved_x is not None and row_scale is not None:
            x_in = saved_x * row_scale.to(saved_x.dtype).unsqueeze(-1)
        dw, db = self.grouped_wgrad(ctx, dy, dyq, x_in)
        return dx, dw, db

    def gemm_output_grad(self, ctx: OpContext, dy):
        """The gradient of the GEMM's rows from the op's output gradient: dy itself, or its gather when
        the forward summed the rows back (``rows_out``). :meth:`grouped_dgrad` and :meth:`grouped_wgrad`
        take the GEMM's."""
        rows_out = ctx.saved[6][1]
        return dy if rows_out is None else rows_out.take(dy)

    def _quantized_backward(self, ctx, dy):
        """dgrad and wgrad from one quantization of dy (rowwise for dgrad, columnwise for wgrad); with
        ``rows_out`` the quantizer casts the gathered rows of the op's output gradient
        (``Quantizer.gathered``: RowGather says why). Off the grid dy is zero padded to [Np] before its
        quantization, and dgrad and wgrad are sliced back to the input's and the weight's shapes."""
        xq, _, wq, (offsets, group_sizes), weight_rg, bias_rg, (rows_in, rows_out) = ctx.saved
        ctx.saved = ()
        wgrad_accumulation.not_added_yet(self.weight)  # as grouped_wgrad does on the other paths
        need_dx = ctx.input_requires_grad
        quantize = self._quantizers.grad_output
        # padded as the forward's weight copy was (the switches may have changed since)
        pad = None if tuple(wq.shape[1:]) == (self.out_features, self.in_features) else self._padding
        dy_q = dy if pad is None else pad.output_grad(dy)  # what is quantized; dy stays for the bias gradient
        if rows_out is not None:
            dyq = quantize.gathered(dy_q, rows_out.index, rows_out.zero_rows, rowwise=need_dx, columnwise=weight_rg,
                                    covers_source=rows_out.covers_source)
            if bias_rg:
                dy = rows_out.take(dy)
        else:
            dyq = quantize(dy_q, rowwise=need_dx, columnwise=weight_rg)
        k = kernels()
        dx = None
        if need_dx:
            dx = k.grouped_mm_quantized_dgrad(dyq, wq, offsets, out_dtype=dy.dtype, group_sizes=group_sizes)
            if pad is not None:
                dx = pad.input_grad(dx)
            if rows_in is not None:
                dx = rows_in.sum_back(dx)
        dw = None
        if weight_rg:
            grad = self._wgrad_accumulator(pad)
            dw = k.grouped_mm_quantized_wgrad(xq, dyq, offsets, num_groups=self.num_groups, out_dtype=self.weight.dtype,
                                              group_sizes=group_sizes, accumulate_into=grad)
            if grad is not None:
                dw = wgrad_accumulation.added_into(self.weight, grad)
            elif pad is not None:
                dw = pad.weight_grad(dw)
        db = bias_grad(dy, offsets, self.num_groups, self.bias.dtype) if bias_rg else None
        return dx, dw, db

    def _wgrad_accumulator(self, pad) -> Optional[torch.Tensor]:
        """The gradient the native wgrad adds into itself (:mod:`.wgrad_accumulation`), or None: autograd adds."""
        return wgrad_accumulation.accumulator(self.weight) if self.fuse_wgrad_accumulation and pad is None else None

    def grouped_dgrad(self, ctx: OpContext, dyq):
        """``dx = dy @ W_e`` per group (None when the input needs no gradient); ``dyq``: the GEMM rows'
        gradient (:meth:`gemm_output_grad`) as quantized."""
        if not ctx.input_requires_grad:
            return None
        saved_w_EKN, (offsets, group_sizes), rows_in = ctx.saved[2], ctx.saved[3], ctx.saved[6][0]
        # Operands checked by this op's forward (autograd fixes dy's shape and dtype): no re-validation.
        dx = kernels().grouped_mm_dgrad(dyq, saved_w_EKN, offsets, group_sizes=group_sizes, validate=False)
        return dx if rows_in is None else rows_in.sum_back(dx)

    def grouped_wgrad(self, ctx: OpContext, dy, dyq, x_in):
        """``(dweight, dbias)`` from the GEMM input ``x_in`` (None when unused) and the GEMM rows' gradient
        ``dy`` (``dyq`` as quantized); releases the saved tensors.

        Separate from dgrad so the grouped-MLP fusion can form ``x_in`` in the same pass as its
        activation backward, which needs dgrad's result."""
        _, _, _, (offsets, group_sizes), weight_rg, bias_rg, _ = ctx.saved
        ctx.saved = ()
        wgrad_accumulation.not_added_yet(self.weight)
        dw = None
        if weight_rg:
            dw = kernels().grouped_mm_wgrad(
                x_in, dyq, offsets, num_groups=self.num_groups, group_sizes=group_sizes, validate=False
            ).transpose(1, 2)
        db = bias_grad(dy, offsets, self.num_groups, self.bias.dtype) if bias_rg else None
        return dw, db

    # ------------------------------------------------------------------ op interface
    def op_forward(self, ctx, x, extra_inputs, recipe):
        self.check_input(x)
        splits = extra_inputs[0]
        rows_in, rows_out = split_rows(splits)
        return self.grouped_forward(ctx, x, self.groups(splits, x), rows_in=rows_in, rows_out=rows_out), ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        dx, dw, db = self.grouped_backward(ctx, dy)
        grads = [dw] if self.bias is None else [dw, db]
        return dx, grads, (None,)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


def bias_grad(dy, offsets, num_groups, dtype):
    from ...gemm.epilogue import bias_grad as _bias_grad

    return _bias_grad(dy, offsets, num_groups, dtype)


def cast_weight_copy(quantizers, w_ENK: torch.Tensor):
    """The weight stack quantized in both GEMM layouts and prepared for the quantized grouped kernels."""
    q = quantizers.weight
    if getattr(q, "num_updates", None) == 0:
        # DelayedScaling: never cast with the initial scale (1, before any amax was seen): a kept copy
        # serves every micro-batch of a step, so record this weight's amax first.
        q.observe(w_ENK)
    return kernels().prepare_quantized_weight(q(w_ENK, rowwise=True, columnwise=True))


def wgrad_copy(xq):
    """What wgrad reads of a quantized input: a block tensor's columnwise copy alone (the rowwise
    copy served fprop and is freed); a per-tensor tensor's transposed data where the cast wrote it."""
    if hasattr(xq, "wgrad_copy"):
        return xq.wgrad_copy()
    columnwise = getattr(xq, "columnwise", None)
    if columnwise is None or getattr(xq, "rowwise", None) is None:
        return xq
    return type(xq)(xq.shape, xq.dtype, xq.fmt, None, columnwise)
