"""Float64 references for the ops tests (plain torch autograd), and shared recipe parameters.

Under a recipe the reference fake-quantizes the same operands with FRESH quantizers of the same
recipe (the op's quantizers are fresh too in these tests), then computes in float64.
"""

from __future__ import annotations

import pytest
import torch

from te_dist.recipe import recipe_from_name

RECIPE_NAMES = ("none", "delayed", "current", "block", "mxfp8", "nvfp4")

# Per-dtype tolerances for op-vs-float64 comparisons (op computes in its dtype).
TOLS = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def make_recipe(name):
    # Deterministic NVFP4: stochastic rounding would make op and reference draw different noise.
    overrides = {"disable_stochastic_rounding": True} if name == "nvfp4" else {}
    return recipe_from_name(name, **overrides)



def fq(x, recipe, role):
    """Fake-quantize like the op does (no-op without recipe); returns float64."""
    if recipe is None:
        return x.double()
    from te_dist.quantization import fake_quantize, make_quantizer

    quantizer = make_quantizer(recipe, role)
    return fake_quantize(x.detach(), quantizer).double()


def quantized_backward(recipe) -> bool:
    return recipe is not None and getattr(recipe, "backward_override", None) is None


def st_quant(x64, recipe, role, dtype):
    """Straight-through fake quantization of a float64 leaf as the op sees it (in ``dtype``)."""
    if recipe is None:
        return x64
    return x64 + (fq(x64.detach().to(dtype), recipe, role) - x64).detach()


def ref_linear(x64, w64, recipe, dtype):
    """y = q(x) @ q(w).T in float64; backward fake-quantizes dy (cast to the op dtype first)."""
    y = st_quant(x64, recipe, "input", dtype) @ st_quant(w64, recipe, "weight", dtype).t()
    return _GradQuant.apply(y, recipe, dtype)


class _GradQuant(torch.autograd.Function):
    """Identity; in backward fake-quantizes dy (cast to the op's dtype first, like the op sees it)."""

    @staticmethod
    def forward(ctx, y, recipe, dy_dtype):
        ctx.recipe, ctx.dy_dtype = recipe, dy_dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        if not quantized_backward(ctx.recipe):
            return dy, None, None
        return fq(dy.to(ctx.dy_dtype), ctx.recipe, "grad_output"), None, None


def ref_grouped_linear(x64, w64_ENK, b64_EN, split_sizes, recipe, dtype):
    """Per-expert float64 reference of GroupedLinear (one quantizer over all experts, like the op)."""
    xq = st_quant(x64, recipe, "input", dtype)
    wq = st_quant(w64_ENK, recipe, "weight", dtype)
    sizes = split_sizes.tolist()
    outs, start = [], 0
    for e, n in enumerate(sizes):
        outs.append(xq[start:start + n] @ wq[e].t())
        start += n
    y = _GradQuant.apply(torch.cat(outs), recipe, dtype)  # dy quantized as one tensor, like the op
    if b64_EN is not None:
        expert_of_row = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        y = y + b64_EN[expert_of_row]
    return y


def ref_swiglu(x, limit=None):
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def assert_close(actual, expected, dtype, what=""):
    tol = TOLS[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), **tol, msg=lambda m: f"{what}: {m}")
