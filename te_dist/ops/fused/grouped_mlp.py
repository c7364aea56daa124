"""Joint forward/backward fusion of the expert MLP: GroupedLinear -> (Scaled)SwiGLU -> GroupedLinear.

Forward: split sizes become offsets once (shared when both GEMMs get the same split-size tensor),
the expert biases ride in grouped_mm's bias epilogue, and without quantization the routing
probabilities ride in the second GEMM's row-scale epilogue (``y = p * (swiglu(h) @ W2) + b2``),
so ``swiglu(h) * p`` is never materialised. Under a recipe the scaled activation is quantized, so
it is formed first (one compiled pass over h) — exactly what the unfused ops quantize. Backward
runs one pass over h and dgrad's output for dh and the probability gradient either way.

Under an FP8 recipe the fused forward asks ``is_op_fuser_grouped_tensor_supported`` once (input
dtype and device, the host sizes' alignment) and both GEMMs follow that answer: the native
quantized path or the emulated one (see GroupedLinear). On the native path the SwiGLU input h
``[T, 2F]``, the largest tensor the MLP keeps for the backward, is kept as E4M3 with 1x128 block
scales (:class:`~te_dist.ops.basic.swiglu.Fp8Input`, written by the pass that forms fc2's input),
so the FP8 recipes hold less than bf16 for the whole MLP, not only for the GEMM operands. Under current
scaling that pass and the backward's also find max |fc2's input| and max |dh| for their casts
(te_dist.quantization.amax_hints), which then skip their amax passes.

fc1's split may carry ``rows_in`` and fc2's ``rows_out`` (te_dist.ops.RowGather: the MoE layer's expand
gather and combine at EP size 1); each GEMM takes its own, fc2 reads fc1's output as it is.

The rule honours ``recipe.enable_fused_grouped_mlp`` (absent means enabled), a public attribute a
user may attach at runtime; it is part of ``str(recipe)`` and therefore of the plan key. Likewise
``recipe.fp8_swiglu_input = False`` keeps h in its own dtype (the backward then reads h exactly).
"""

from __future__ import annotations


from ..basic import GroupedLinear, ScaledSwiGLU, SwiGLU
from ..basic.grouped_linear import GroupSplits, check_rows_out, host_split_alignment, split_rows, support
from ..basic.swiglu import (scaled_swiglu_backward, scaled_swiglu_forward, scaled_swiglu_forward_keeping_fp8,
                             swiglu_forward)
from ..op import FusedOperation
from ..rules import FusionRule

__all__ = ["GroupedMLP", "FORWARD_GROUPED_MLP", "BACKWARD_GROUPED_MLP"]


class GroupedMLP(FusedOperation):
    def fuser_forward(self, ctxs, x, extra_inputs, recipe):
        fc1, act, fc2 = self.basic_ops
        c1, c2, c3 = ctxs
        splits1, splits2 = extra_inputs[0][0], extra_inputs[2][0]
        fc1.check_input(x)
        rows_in, rows_out = _mlp_rows(splits1, splits2)
        groups1 = fc1.groups(splits1, x)
        if splits2 is splits1 or _same_split(splits1, splits2):
            groups2 = groups1
            if rows_out is not None:
                check_rows_out(rows_out, groups1[1], x)
        else:
            groups2 = fc2.groups(splits2, x, num_rows=None if rows_in is None else rows_in.num_rows)
        native = None
        if fc1.quantizers.active:  # one predicate answer per fused forward, for both GEMMs
            native = fc1.native_path(x, groups1[1], _op_fuser_predicate()) and fc2.native_shape_ok and (
                groups2 is groups1 or host_split_alignment(groups2[1]) == host_split_alignment(groups1[1]))
        h = fc1.grouped_forward(c1, x, groups1, native=native, rows_in=rows_in)
        if isinstance(act, ScaledSwiGLU):
            probs_in = extra_inputs[1][0]
            probs = act.check_scales(h, probs_in)
            kept = h
            if fc2.quantizers.active:
                fused = None
                if native and c2.requires_grad and getattr(recipe, "fp8_swiglu_input", True):
                    fused = scaled_swiglu_forward_keeping_fp8(h, probs, act.limit,
                                                              tell_amax=_takes_amax(fc2.quantizers.input))
                if fused is None:
                    a = scaled_swiglu_forward(h, probs, act.limit)
                else:
                    a, kept = fused
                y = fc2.grouped_forward(c3, a, groups2, native=native, rows_out=rows_out)
            else:
                y = fc2.grouped_forward(c3, swiglu_forward(h, act.limit), groups2, row_scale=probs, rows_out=rows_out)
            if c2.requires_grad:
                c2.saved = (kept, probs, probs_in.shape, probs_in.requires_grad)
        else:
            if c2.requires_grad:
                c2.saved = (h,)
            y = fc2.grouped_forward(c3, swiglu_forward(h, act.limit), groups2, native=native, rows_out=rows_out)
        return y, [(), (), ()]

    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        fc1, act, fc2 = self.basic_ops
        c1, c2, c3 = ctxs
        if isinstance(act, ScaledSwiGLU) and c3.saved and c3.saved[1] is not None:
            # Row-scale forward (no quantization): one fused pass over h and dgrad's output gives
            # dh, the probability gradient and swiglu(h) * probs, the input of fc2's wgrad.
            h, probs, probs_shape, probs_rg = c2.saved
            c2.saved = ()
            dy = fc2.gemm_output_grad(c3, dy)
            da = fc2.grouped_dgrad(c3, dy)
            dh, dprobs, scaled = scaled_swiglu_backward(da, h, probs, act.limit)
            dw2, db2 = fc2.grouped_wgrad(c3, dy, dy, scaled)
            act_extra = (dprobs.to(probs.dtype).reshape(probs_shape) if probs_rg else None,)
        elif isinstance(act, ScaledSwiGLU):
            # Quantized fc2 (its input was formed and saved in the forward): the same one pass over
            # h (or its FP8 copy) and da for dh and the probability gradient, without re-forming
            # swiglu(h) * probs.
            h, probs, probs_shape, probs_rg = c2.saved
            c2.saved = ()
            da, dw2, db2 = fc2.grouped_backward(c3, dy)
            dh, dprobs, _ = scaled_swiglu_backward(da, h, probs, act.limit, want_scaled=False,
                                                   tell_amax=_takes_amax(fc1.quantizers.grad_output))
            act_extra = (dprobs.to(probs.dtype).reshape(probs_shape) if probs_rg else None,)
        else:
            da, dw2, db2 = fc2.grouped_backward(c3, dy)
            dh, _, act_extra = act.op_backward(c2, da, ())
        dx, dw1, db1 = fc1.grouped_backward(c1, dh)
        g1 = [dw1] if fc1.bias is None else [dw1, db1]
        g2 = [dw2] if fc2.bias is None else [dw2, db2]
        return dx, [g1, [], g2], [(None,), act_extra, (None,)]


def _mlp_rows(splits1, splits2):
    """(fc1's rows_in, fc2's rows_out): each split's rows apply to the op it is handed to, so fc1's
    split has no rows_out (fc1's output feeds the activation) and fc2's no rows_in."""
    rows_in, fc1_out = split_rows(splits1)
    fc2_in, rows_out = split_rows(splits2)
    if fc1_out is not None or fc2_in is not None:
        raise ValueError("in the grouped MLP only fc1's split may carry rows_in and only fc2's rows_out, got "
                         f"{'rows_out on fc1' if fc1_out is not None else 'rows_in on fc2'}")
    return rows_in, rows_out


def _same_split(a, b) -> bool:
    """Two GroupSplits of the same offsets and sizes objects (the MoE layer hands fc2 fc1's split
    with its rows the other way round): validated once."""
    return isinstance(a, GroupSplits) and isinstance(b, GroupSplits) and a.offsets is b.offsets and a.sizes is b.sizes


def _takes_amax(quantizer) -> bool:
    """Whether the cast of a tensor takes its amax from the kernel that writes it (current scaling: amax_hints)."""
    return quantizer is not None and quantizer.takes_amax_hint


def _op_fuser_predicate():
    return support().is_op_fuser_grouped_tensor_supported


def _build(ops, recipe):
    if not getattr(recipe, "enable_fused_grouped_mlp", True):
        return None
    fc1, _, fc2 = ops
    if fc1.num_groups != fc2.num_groups or fc1.out_features != 2 * fc2.in_features:
        return None
    if fc1.weight.dtype != fc2.weight.dtype or fc1.weight.device != fc2.weight.device:
        return None
    return GroupedMLP(ops)


_PATTERN = (GroupedLinear, (ScaledSwiGLU, SwiGLU), GroupedLinear)
FORWARD_GROUPED_MLP = FusionRule("forward_grouped_mlp", "forward", _PATTERN, _build)
BACKWARD_GROUPED_MLP = FusionRule("backward_grouped_mlp", "backward", _PATTERN, _build)
