"""Element formats: torch dtypes, largest values, operand roles, input validation.

Why a table here and not in ``recipe.py``: recipes describe settings, this module owns what a
format *is* numerically (which torch dtype stores it, its largest finite value, its largest
exponent, used by the OCP MX shared-exponent rule).
"""

from __future__ import annotations

import torch

from ..recipe import Format

__all__ = [
    "ROLES",
    "FP8_DTYPES",
    "FP8_MAX",
    "FP8_EMAX",
    "E2M1_MAX",
    "E4M3_MAX",
    "check_role",
    "check_input",
    "fp8_dtype",
    "format_for_role",
]

ROLES = ("input", "weight", "grad_output")

FP8_DTYPES = {Format.E4M3: torch.float8_e4m3fn, Format.E5M2: torch.float8_e5m2}
FP8_MAX = {Format.E4M3: 448.0, Format.E5M2: 57344.0}
# Exponent of the largest power of two a format represents (448 = 1.75 * 2**8, 57344 = 1.75 * 2**15);
# the OCP MX spec calls it emax_elem and subtracts it from floor(log2(amax)).
FP8_EMAX = {Format.E4M3: 8, Format.E5M2: 15}
E2M1_MAX = 6.0
E4M3_MAX = 448.0

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role


def format_for_role(fmt: Format, role: str) -> Format:
    """Concrete element format of an operand: HYBRID is E4M3 for input/weight, E5M2 for grad_output."""
    return fmt.for_role(check_role(role))


def fp8_dtype(fmt: Format) -> torch.dtype:
    try:
        return FP8_DTYPES[fmt]
    except KeyError:
        raise ValueError(f"{fmt!r} is not an FP8 format; expected one of {list(FP8_DTYPES)}") from None


def check_input(x, what: str = "x") -> torch.Tensor:
    """Reject what no recipe can quantize, before any kernel runs."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{what} must have a floating dtype in {[str(d) for d in _FLOAT_DTYPES]} to be quantized, got {x.dtype}"
        )
    return x
