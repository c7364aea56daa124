"""Quantization numerics for every recipe, on CPU and GPU.

Pipeline of one quantized linear layer (roles in brackets; see ``gemm`` for the operand rules)::

    forward   x [input] ──quantize rowwise──┐
              w [weight] ─quantize rowwise──┴─ fprop GEMM ─> y
    backward  dy [grad_output] ─rowwise──┐
              w [weight] ───columnwise───┴─ dgrad GEMM ─> dx
              dy [grad_output] ─columnwise (NVFP4: RHT)─┐
              x [input] ────────columnwise (NVFP4: RHT)─┴─ wgrad GEMM ─> dw

Modules: ``formats`` (dtypes, maxima), ``e2m1`` (FP4 grid, packing), ``hadamard`` (RHT),
``scaling`` (pure scale math), ``cast`` (one quantize function per format, compiled on CUDA by
``compile``; on CUDA the FP8 casts run as fused Triton kernels instead: ``fused`` decides,
``triton_casts`` holds them), ``tensors`` (containers and layouts), ``quantizer``/``per_tensor``/``blockwise``
(stateful quantizers), ``api`` (``make_quantizer``, ``quantize``, ``fake_quantize``), ``gemm``
(emulated GEMMs), ``native`` (``torch._scaled_mm`` paths on SM89+).
"""

from .api import QUANTIZER_TYPES, fake_quantize, make_quantizer, quantize
from .blockwise import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer
from .compile import set_compile_enabled
from .fused import fused_casts_available, set_fused_casts_enabled
from .gemm import emulated_gemm, emulated_grouped_gemm
from .native import native_fp8_gemm_supported, native_fp8_grouped_gemm_supported, scaled_gemm, scaled_grouped_gemm
from .per_tensor import CurrentScalingQuantizer, DelayedScalingQuantizer
from .quantizer import Quantizer
from .tensors import (
    BlockScaledData,
    BlockScaledTensor,
    Float8BlockTensor,
    Float8Tensor,
    MXFP8Tensor,
    NVFP4Tensor,
    QuantizedTensor,
)

__all__ = [
    "quantize",
    "make_quantizer",
    "fake_quantize",
    "emulated_gemm",
    "emulated_grouped_gemm",
    "scaled_gemm",
    "scaled_grouped_gemm",
    "native_fp8_gemm_supported",
    "native_fp8_grouped_gemm_supported",
    "set_compile_enabled",
    "set_fused_casts_enabled",
    "fused_casts_available",
    "QUANTIZER_TYPES",
    "Quantizer",
    "DelayedScalingQuantizer",
    "CurrentScalingQuantizer",
    "Float8BlockQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "QuantizedTensor",
    "Float8Tensor",
    "BlockScaledData",
    "BlockScaledTensor",
    "Float8BlockTensor",
    "MXFP8Tensor",
    "NVFP4Tensor",
]
