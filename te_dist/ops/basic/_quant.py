"""Recipe state of GEMM ops: one quantizer per operand role, and the backward_override policy.

Why a small helper: BasicLinear, GroupedLinear and Quantize all need the same three quantizers
("input", "weight", "grad_output") rebuilt together when the recipe key changes, and the same
reading of ``recipe.backward_override`` (None: quantize backward operands; "high_precision":
backward GEMMs use the unquantized operands; "dequantized": backward reuses the dequantized
forward operands and leaves gradients unquantized).
"""

from __future__ import annotations

__all__ = ["GemmQuantizers", "fake_quantize_or_identity"]

_ROLES = ("input", "weight", "grad_output")


class GemmQuantizers:
    """Quantizers for one op under one recipe (all None without a recipe)."""

    __slots__ = ("input", "weight", "grad_output", "backward_override", "settings_key")

    def __init__(self, recipe, roles=_ROLES):
        self.input = self.weight = self.grad_output = None
        self.backward_override = None
        self.settings_key = None
        if recipe is None:
            return
        from ...quantization import make_quantizer  # lazy: keeps `import te_dist.ops` light

        self.settings_key = str(recipe)
        self.backward_override = getattr(recipe, "backward_override", None)
        for role in roles:
            setattr(self, role, make_quantizer(recipe, role))
        if self.backward_override is not None:
            self.grad_output = None  # gradients stay in high precision

    @property
    def active(self) -> bool:
        return self.settings_key is not None

    @property
    def save_quantized_operands(self) -> bool:
        """Whether backward GEMMs reuse the fake-quantized forward operands."""
        return self.backward_override != "high_precision"


def fake_quantize_or_identity(x, quantizer):
    if quantizer is None:
        return x
    from ...quantization import fake_quantize

    return fake_quantize(x, quantizer)
