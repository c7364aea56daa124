"""Recipe state of GEMM ops: one quantizer per operand role, and the backward_override policy.

Why a small helper: BasicLinear, GroupedLinear and Quantize all need the same three quantizers
("input", "weight", "grad_output") rebuilt together when the recipe key changes, and the same
reading of ``recipe.backward_override`` (None: quantize backward operands; "high_precision":
backward GEMMs use the unquantized operands; "dequantized": backward reuses the dequantized
forward operands and leaves gradients unquantized).

Emulation note: every operand is fake-quantized along its last dim ("rowwise") once, in forward,
and backward GEMMs reuse those copies. TransformerEngine quantizes wgrad operands along the token
dim ("columnwise") instead; for per-tensor recipes the two are identical, for block recipes the
block orientation of the wgrad operands differs (see docs/fusion.md, "Limitations").
"""

from __future__ import annotations

import torch

__all__ = ["GemmQuantizers", "fake_quantize_or_identity"]

_ROLES = ("input", "weight", "grad_output")


class GemmQuantizers:
    """Quantizers for one op under one recipe (all None without a recipe)."""

    __slots__ = ("input", "weight", "grad_output", "backward_override", "settings_key", "active",
                 "save_quantized_operands", "recipe")

    def __init__(self, recipe, roles=_ROLES):
        self.input = self.weight = self.grad_output = None
        self.backward_override = None
        self.settings_key = None
        self.active = recipe is not None  # plain attributes: read on every GEMM call
        self.save_quantized_operands = True
        self.recipe = recipe  # what the support predicates are asked about
        if recipe is None:
            return
        from ...autocast import get_recipe_group
        from ...quantization import make_quantizer  # lazy: keeps `import te_dist.ops` light

        self.settings_key = str(recipe)
        self.backward_override = getattr(recipe, "backward_override", None)
        # DelayedScaling reduces amax over the autocast group (the ranks that agreed on the recipe).
        group = get_recipe_group() if getattr(recipe, "reduce_amax", False) else None
        for role in roles:
            setattr(self, role, make_quantizer(recipe, role, group=group))
        if self.backward_override is not None:
            self.grad_output = None  # gradients stay in high precision
        # Whether backward GEMMs reuse the fake-quantized forward operands.
        self.save_quantized_operands = self.backward_override != "high_precision"


def fake_quantize_or_identity(x, quantizer):
    """x fake-quantized by ``quantizer`` (x itself without one). A shape off the quantizer's block grid
    (an expert dim of 2880 under 128-wide blocks) is padded with zeros to the grid and sliced back:
    zeros change no block's scale, so every real element gets the value an exact tiling would give,
    and a layer's forward never raises for its feature sizes."""
    if quantizer is None:
        return x
    from ...quantization import fake_quantize

    rows_multiple, cols_multiple = quantizer.block_shape
    rows, cols = (x.shape[-2] if x.dim() > 1 else None), x.shape[-1]
    pad_rows, pad_cols = (0 if rows is None else -rows % rows_multiple), -cols % cols_multiple
    if not (pad_rows or pad_cols):
        return fake_quantize(x, quantizer)
    out = fake_quantize(torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows)), quantizer)
    # contiguous: the GEMMs take a weight's K-major layout as it is
    return (out[..., :cols] if rows is None else out[..., :rows, :cols]).contiguous()
