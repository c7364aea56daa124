"""The same-run A/B baseline of the tensor-scaled FP8 kernels, shared by the FP8 benchmarks.

Inside ``scale_tables()`` per-tensor operands run on the block-scaled kernels with each scale
broadcast into block tables per call: the path a call that mixes scalings takes. A recipe named
``NAME:tables`` in a benchmark's recipe list runs this way.
"""

from __future__ import annotations

import contextlib

from te_dist.backends import fp8_cutlass_backend
from te_dist.backends.fp8_operands import tensor_scales


@contextlib.contextmanager
def scale_tables(enabled: bool = True):
    fp8_cutlass_backend.tensor_scales = (lambda *operands: False) if enabled else tensor_scales
    try:
        yield
    finally:
        fp8_cutlass_backend.tensor_scales = tensor_scales
