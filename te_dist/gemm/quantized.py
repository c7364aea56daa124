"""The quantized (FP8) grouped-GEMM entry points: the same validate, decide, run stack.

They take the operands as the recipe's quantizers made them (``Float8Tensor`` or
``Float8BlockTensor`` activations, a weight prepared once per version by ``prepare_quantized_weight``)
and run on our block-scaled CUTLASS kernels, on cuBLAS per expert, or on the emulated reference
(dequantize the same operands, then the bf16 grouped GEMM) wherever the kernels cannot run
(``decide.choose_quantized``). All multiply the same quantized values; only the accumulation differs."""

from __future__ import annotations

import torch

from .. import settings as _settings
from . import cutlass_backend, decide, fp8_loop_backend
from .fp8_operands import QuantizedWeight, copy_format, dequantized, fp8_format, tensor_scales
from .entry import grouped_mm_dgrad, grouped_mm_forward, grouped_mm_wgrad
from .validation import check_offsets_tensor, check_quantized

__all__ = ["grouped_mm_quantized_forward", "grouped_mm_quantized_dgrad", "grouped_mm_quantized_wgrad"]


def _emulated_forward(xq, wq, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes):
    w = dequantized(wq, "rowwise", out_dtype)
    return grouped_mm_forward(dequantized(xq, "rowwise", out_dtype), w.transpose(1, 2), offsets_E, bias_EN=bias_EN,
                              row_scale_T=row_scale_T, out_dtype=out_dtype, check_offsets=False, group_sizes=group_sizes)


def _emulated_dgrad(dyq, wq, offsets_E, out_dtype, group_sizes):
    w = dequantized(wq, "columnwise", out_dtype)
    return grouped_mm_dgrad(dequantized(dyq, "rowwise", out_dtype), w.transpose(1, 2), offsets_E, out_dtype=out_dtype,
                            group_sizes=group_sizes, validate=False)


def _emulated_wgrad(xq, dyq, offsets_E, num_groups, out_dtype, group_sizes=None, out=None):
    x, dy = dequantized(xq, "columnwise", out_dtype), dequantized(dyq, "columnwise", out_dtype)
    dw = grouped_mm_wgrad(x, dy, offsets_E, num_groups=num_groups, out_dtype=out_dtype, validate=False).transpose(1, 2)
    return dw if out is None else out.add_(dw)


_RUN = {  # direction -> {backend: function}, every one taking the direction's arguments
    "fwd": {"cutlass": cutlass_backend.fp8_guarded(cutlass_backend.fp8_forward, _emulated_forward),
            "loop": fp8_loop_backend.forward, "emulated": _emulated_forward},
    "dgrad": {"cutlass": cutlass_backend.fp8_guarded(cutlass_backend.fp8_dgrad, _emulated_dgrad),
              "loop": fp8_loop_backend.dgrad, "emulated": _emulated_dgrad},
    "wgrad": {"cutlass": cutlass_backend.fp8_guarded(cutlass_backend.fp8_wgrad, _emulated_wgrad),
              "loop": fp8_loop_backend.wgrad, "emulated": _emulated_wgrad},
}


def _decide_rows(direction: str, name: str, aq, wq, offsets_E, out_dtype, backend, group_sizes, epilogue) -> str:
    """The checks and the decision of fwd (``aq`` = x against the prepared weight's K) or dgrad (dy against its N)."""
    check_quantized(name, aq, 2)
    check_quantized("wq", wq, 3)
    E, N, K = wq.shape
    contraction = K if direction == "fwd" else N
    if aq.shape[1] != contraction:
        raise ValueError(f"{name} has {aq.shape[1]} features but the weight [E={E}, N={N}, K={K}] "
                         f"{'takes K' if direction == 'fwd' else 'gives N'}={contraction}")
    device = aq.device  # a 2-D quantized tensor (a prepared weight is 3-D)
    check_offsets_tensor(offsets_E, E, name, device)
    return decide.choose_quantized(
        device, K, N, out_dtype=out_dtype, b_format=fp8_format(wq.fwd_data), backend=backend, group_sizes=group_sizes,
        num_rows=aq.shape[0], num_groups=E, block_scales=not tensor_scales(aq, wq), a_format=copy_format(aq, "rowwise"),
        epilogue=epilogue, contraction=contraction)


def grouped_mm_quantized_forward(xq, wq: QuantizedWeight, offsets_E, *, bias_EN=None, row_scale_T=None,
                                 out_dtype=torch.bfloat16, backend=None, group_sizes=None) -> torch.Tensor:
    """y[T, N] = row_scale * (x @ w[e]^T) + bias[e] from quantized x [T, K] and a prepared weight [E, N, K]."""
    name = _decide_rows("fwd", "xq", xq, wq, offsets_E, out_dtype, backend, group_sizes,
                        bias_EN is not None or row_scale_T is not None)
    return _RUN["fwd"][name](xq, wq, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes)


def grouped_mm_quantized_dgrad(dyq, wq: QuantizedWeight, offsets_E, *, out_dtype=torch.bfloat16, backend=None,
                               group_sizes=None) -> torch.Tensor:
    """dx[T, K] = dy @ w[e] from quantized dy [T, N] and a prepared weight [E, N, K]."""
    name = _decide_rows("dgrad", "dyq", dyq, wq, offsets_E, out_dtype, backend, group_sizes, False)
    return _RUN["dgrad"][name](dyq, wq, offsets_E, out_dtype, group_sizes)


def grouped_mm_quantized_wgrad(xq, dyq, offsets_E, *, num_groups: int, out_dtype=torch.bfloat16, backend=None,
                               group_sizes=None, accumulate_into=None) -> torch.Tensor:
    """dw[e] = dy_e^T @ x_e as [E, N, K] from the columnwise copies of quantized x [T, K] and dy [T, N].
    Every group's first row must be a multiple of the recipe's split alignment (128 for block
    scales, 16 for per-tensor): the caller guarantees it (the support predicates ask).
    ``accumulate_into``: a contiguous [E, N, K] tensor, ``out_dtype`` or float32 (Megatron's main_grad), dw is added
    into (returned): in the CUTLASS epilogue where ``te_dist.settings.fp8_wgrad_accumulation`` is on, else after it."""
    check_quantized("xq", xq, 2)
    check_quantized("dyq", dyq, 2)
    if xq.shape[0] != dyq.shape[0]:
        raise ValueError(f"xq has {xq.shape[0]} rows but dyq has {dyq.shape[0]}")
    (T, K), N, device, acc = xq.shape, dyq.shape[1], xq.device, accumulate_into
    check_offsets_tensor(offsets_E, num_groups, "xq", device)
    if acc is not None and not (isinstance(acc, torch.Tensor) and acc.shape == (num_groups, N, K) and acc.dtype in
                                (out_dtype, torch.float32) and acc.device == device and acc.is_contiguous()):
        got = f"{tuple(acc.shape)} {acc.dtype} on {acc.device}{'' if acc.is_contiguous() else ', not contiguous'}" \
            if isinstance(acc, torch.Tensor) else type(acc).__name__
        raise ValueError(f"accumulate_into must be a contiguous {(num_groups, N, K)} {out_dtype} or float32 tensor on "
                         f"{device}, received {got}")
    fused = [acc] if acc is not None and _settings.current().fp8_wgrad_accumulation else []  # the add in the epilogue
    name = decide.choose_quantized(  # an epilogue: never cuBLAS per expert
        device, K, N, out_dtype=out_dtype, b_format=copy_format(xq, "columnwise"), backend=backend,
        group_sizes=group_sizes, num_rows=T, num_groups=num_groups, block_scales=not tensor_scales(xq, dyq),
        a_format=copy_format(dyq, "columnwise"), epilogue=bool(fused), wgrad=True, contraction=T)
    fused = fused if name == "cutlass" else []
    dw = _RUN["wgrad"][name](xq, dyq, offsets_E, num_groups, acc.dtype if fused else out_dtype, group_sizes, *fused)
    return dw if acc is None or fused else acc.add_(dw)  # else autograd's own in-place add, after the GEMM
