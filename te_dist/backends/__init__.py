"""Grouped-GEMM backends behind ``te_dist.kernels`` (the one public entry).

Stack, per direction (forward, dgrad, wgrad)::

    validation.check_*          user errors, before any launch
    selection.choose_backend    a readable table: cutlass -> torch._grouped_mm -> per-expert loop
    {cutlass,torch,loop}_backend  each writes y = row_scale * (x @ w[e]) + bias[e]
    grouped_mm_function.GroupedMM autograd: dx (dgrad), dw (wgrad), dbias, drow_scale

``loop_backend`` doubles as the float32 reference used by the tests.
"""

__all__: list = []
