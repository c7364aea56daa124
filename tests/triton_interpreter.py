"""Triton's interpreter with the GPU's float conversions, for the CPU runs of our Triton kernels.

The interpreter's own conversions are wrong for fp32 -> E4M3 (rounds ties away, breaks subnormals, turns NaN into
256) and for bf16/fp16 subnormals -> fp32 (flushes them); torch's conversions round like the GPU's ``cvt.rn``. So a
test routes those through torch and checks the kernels' logic bit for bit, and the ``gpu`` cases the hardware's."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
#: kernels run in Triton's interpreter on CPU tensors: triton installed and TRITON_INTERPRET=1 set before its import
needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
                                       reason="Triton interpreter run: needs triton and TRITON_INTERPRET=1")


def patch_interpreter_conversions(monkeypatch):
    """Route the interpreter's float conversions among float32 / fp16 / bf16 / E4M3 / E5M2 through torch."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original = interp._convert_float
    torch_types = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                   tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    rtne = (None, interp._ir.ROUNDING_MODE.RTNE)

    def convert(data, src, dst, rounding):
        if src not in torch_types or dst not in torch_types or rounding not in rtne:
            return original(data, src, dst, rounding)
        raw = torch.from_numpy(np.ascontiguousarray(data).copy().view(np.uint8)).view(torch_types[src])
        out = raw.to(torch_types[dst])
        return out.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[out.element_size()]).numpy().view(
            getattr(np, f"uint{8 * out.element_size()}")).reshape(data.shape)

    monkeypatch.setattr(interp, "_convert_float", convert)
