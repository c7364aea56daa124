"""Grouped GEMM for expert MLPs: one entry per direction, whatever runs underneath.

Stack of one call, every direction (forward, dgrad, wgrad; bf16 and others in entry.py, FP8 in quantized.py)::

    validation.check_*     user errors, before any launch (no host sync)
    decide.choose*         the one rule: torch._grouped_mm by default; our CUTLASS kernels for fused
                           epilogues and FP8; cuBLAS per expert for few large experts; a measured
                           entry (measure.tuner().entry) may override where it wins by a margin
    *_backend              torch_backend, cutlass_backend (bf16 and FP8), loop_backend, fp8_loop_backend
    autograd.GroupedMM     dx (dgrad), dw (wgrad), dbias, drow_scale

``loop_backend`` is also the float32 reference; ``te_dist.kernels`` is this package's public face.
"""

from .decide import BACKENDS, QUANTIZED_BACKENDS
from .decide import choose_quantized as select_quantized_backend
from .fp8_operands import QuantizedWeight
from .fp8_operands import prepare_weight as prepare_quantized_weight
from .entry import (available_backends, describe_choice, grouped_mm, grouped_mm_dgrad, grouped_mm_forward,
                         grouped_mm_wgrad, select_backend)
from .quantized import grouped_mm_quantized_dgrad, grouped_mm_quantized_forward, grouped_mm_quantized_wgrad

__all__ = ["grouped_mm", "grouped_mm_forward", "grouped_mm_dgrad", "grouped_mm_wgrad", "select_backend",
           "describe_choice", "available_backends", "BACKENDS", "QUANTIZED_BACKENDS", "QuantizedWeight",
           "prepare_quantized_weight", "grouped_mm_quantized_forward", "grouped_mm_quantized_dgrad",
           "grouped_mm_quantized_wgrad", "select_quantized_backend"]
