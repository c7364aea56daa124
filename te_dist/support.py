"""Device-keyed, cached capability predicates for the grouped (single-launch) GEMM path.

Why cached: the predicates run on every fusible-op call, so a hit must cost about a dict lookup.
Why device-keyed: the answer depends on the device's compute capability (bf16 grouped on SM90+;
MXFP8 / NVFP4 native only on SM100+; CPU runs the reference path), so a result computed for one
GPU is never reused for another. The key holds exactly the recipe settings a check reads (not
the recipe object, which is mutable), the dtype, the split alignment where the check reads it,
and the device. Nothing here reads split sizes from a GPU tensor (no host sync).

Rules (``cap`` = compute capability; CPU answers True for every recipe: the emulated reference
path keeps grouped semantics there):

| recipe | settings read | CUDA rule (module) |
|---|---|---|
| None | - | cap >= 9.0 and dtype bf16 |
| DelayedScaling, Float8CurrentScaling | fp8_format | cap >= 9.0, dtype bf16/fp16, fp8_format != E5M2, split_alignment % 16 == 0 |
| Float8BlockScaling | x/w/grad_block_scaling_dim | cap == 9.x, cutlass FP8 block kernels present (not yet: ``FP8_BLOCK_KERNELS``), x and grad dims 1, split_alignment % 128 == 0 |
| MXFP8BlockScaling | fp8_format | cap >= 10.0, dtype bf16/fp16, fp8_format != E5M2, split_alignment % 32 == 0 |
| NVFP4BlockScaling | disable_2d_quantization | cap >= 10.0, dtype bf16, split_alignment % 16 == 0 (2D blocks) or % 32 == 0 (1D, ``disable_2d_quantization=True``) |

The op-fuser predicate (fused grouped MLP) additionally needs bf16 activations on CUDA.
``split_alignment=None`` means "unknown" and fails every rule that reads it.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from . import recipe as _recipe

__all__ = [
    "is_module_grouped_tensor_supported",
    "is_op_fuser_grouped_tensor_supported",
    "FP8_BLOCK_KERNELS",
    "set_capability_lookup",
    "capability_lookup",
    "resolve_device",
]

# Flip when cutlass_kernels gains block-scaled FP8 grouped GEMMs (issue 5 leaves them out).
FP8_BLOCK_KERNELS = False


class _Spec(NamedTuple):
    tag: str
    read: Callable  # recipe -> the settings this check reads (hashable; enums as their string value)
    uses_alignment: bool


def _no_settings(_recipe_obj):
    return ()


_SPECS = {
    type(None): _Spec("none", _no_settings, False),
    _recipe.DelayedScaling: _Spec("fp8_tensor", operator.attrgetter("fp8_format._value_"), True),
    _recipe.Float8CurrentScaling: _Spec("fp8_tensor", operator.attrgetter("fp8_format._value_"), True),
    _recipe.Float8BlockScaling: _Spec(
        "fp8_block",
        operator.attrgetter("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"),
        True,
    ),
    _recipe.MXFP8BlockScaling: _Spec("mxfp8", operator.attrgetter("fp8_format._value_"), True),
    _recipe.NVFP4BlockScaling: _Spec("nvfp4", operator.attrgetter("disable_2d_quantization"), True),
}


def _spec_for(recipe_obj) -> _Spec:
    for cls in type(recipe_obj).__mro__:  # subclasses use their base's rule
        spec = _SPECS.get(cls)
        if spec is not None:
            return spec
    raise TypeError(
        f"recipe must be None or a te_dist.recipe.Recipe of a known class, received {type(recipe_obj).__name__}"
    )


# --------------------------------------------------------------------------- devices


def _default_capability(device: torch.device) -> Optional[Tuple[int, int]]:
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


_capability_lookup: Callable = _default_capability


def capability_lookup(device: torch.device) -> Optional[Tuple[int, int]]:
    """Compute capability of ``device`` (None for non-CUDA devices) via the installed lookup."""
    return _capability_lookup(device)


@contextlib.contextmanager
def set_capability_lookup(fn: Callable):
    """Install ``fn(device) -> (major, minor) | None`` (tests inject fake GPUs); clears the caches."""
    global _capability_lookup
    previous = _capability_lookup
    _capability_lookup = fn
    _clear_all()
    try:
        yield
    finally:
        _capability_lookup = previous
        _clear_all()


def resolve_device(device) -> torch.device:
    """Normalise ``device`` to an indexed torch.device; None means the current device (a lookup)."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if not isinstance(device, torch.device):
        if not isinstance(device, (str, int)):
            raise TypeError(f"device must be None, a torch.device, str or int, received {type(device).__name__}")
        device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# --------------------------------------------------------------------------- rules

_LOW_PRECISION_ACT = (torch.bfloat16, torch.float16)


def _aligned(split_alignment, multiple: int) -> bool:
    return split_alignment is not None and split_alignment % multiple == 0


def _module_rule(tag: str, settings, dtype, split_alignment, cap) -> bool:
    if cap is None:  # CPU: reference (emulated) grouped path for every recipe
        return dtype in (torch.bfloat16, torch.float16, torch.float32)
    if cap < (9, 0):
        return False
    if tag == "none":
        return dtype == torch.bfloat16
    if dtype not in _LOW_PRECISION_ACT:
        return False
    if tag == "fp8_tensor":
        return settings != _recipe.Format.E5M2.value and _aligned(split_alignment, 16)
    if tag == "fp8_block":
        x_dim, _w_dim, grad_dim = settings
        return (cap[0] == 9 and FP8_BLOCK_KERNELS and x_dim == 1 and grad_dim == 1
                and _aligned(split_alignment, 128))
    if tag == "mxfp8":
        return cap >= (10, 0) and settings != _recipe.Format.E5M2.value and _aligned(split_alignment, 32)
    if tag == "nvfp4":
        # 16-row splits keep the 16x16 blocks of the wgrad operands inside one expert; the 1D
        # variant quantizes those operands columnwise in 32-row tiles instead.
        multiple = 16 if not settings else 32
        return cap >= (10, 0) and dtype == torch.bfloat16 and _aligned(split_alignment, multiple)
    raise AssertionError(f"unhandled tag {tag}")  # internal invariant: _SPECS and rules agree


def _op_fuser_rule(tag, settings, dtype, split_alignment, cap) -> bool:
    if cap is not None and dtype != torch.bfloat16:
        return False
    return _module_rule(tag, settings, dtype, split_alignment, cap)


# --------------------------------------------------------------------------- cached predicates


def _make_predicate(name: str, rule: Callable, doc: str):
    """Build a predicate whose hits cost: one dict get for the recipe class, one for the device,
    one settings read (C attrgetter) and one C ``lru_cache`` lookup (thread-safe, exact stats)."""

    @functools.lru_cache(maxsize=None)
    def evaluate(tag, settings, dtype, split_alignment, device) -> bool:
        _check_args(dtype, split_alignment)
        return rule(tag, settings, dtype, split_alignment, _capability_lookup(device))

    spec_get = _SPECS.get
    device_get = _DEVICE_MEMO.get
    device_cls = torch.device

    def predicate(recipe, dtype, *, split_alignment=None, device=None) -> bool:
        spec = spec_get(recipe.__class__)
        if spec is None:
            spec = _spec_for(recipe)
        # An indexed torch.device is already normalised (reading .index is cheap; .type and
        # hashing a torch.device are not), so only other forms go through the memo.
        if device.__class__ is device_cls and device.index is not None:
            dev = device
        else:
            dev = device_get(device)
            if dev is None:
                dev = _normalise_device(device)
        tag, read, uses_alignment = spec
        if uses_alignment:
            return evaluate(tag, read(recipe), dtype, split_alignment, dev)
        return evaluate(tag, (), dtype, None, dev)

    def uncached(recipe, dtype, *, split_alignment=None, device=None) -> bool:
        spec = _spec_for(recipe)
        _check_args(dtype, split_alignment)
        dev = resolve_device(device)
        return rule(spec.tag, spec.read(recipe), dtype, split_alignment if spec.uses_alignment else None,
                    _capability_lookup(dev))

    predicate.__name__ = predicate.__qualname__ = name
    predicate.__doc__ = doc
    predicate.__wrapped__ = uncached
    predicate.cache_info = evaluate.cache_info
    predicate.cache_clear = evaluate.cache_clear
    _ALL.append(evaluate.cache_clear)
    return predicate


# Indexed devices map to themselves (a C-hashed dict hit instead of reading device.type, which
# builds a new string per call). Unindexed "cuda" and None are resolved on every call.
_DEVICE_MEMO: dict = {}


def _normalise_device(device) -> torch.device:
    try:
        hash(device)
    except TypeError:
        raise TypeError(f"device must be None, a torch.device, str or int, received {type(device).__name__}") from None
    dev = resolve_device(device)
    if device is not None and not (dev.type == "cuda" and (not isinstance(device, (torch.device, str, int))
                                                         or torch.device(device).index is None)):
        _DEVICE_MEMO[device] = dev
    return dev


def _check_args(dtype, split_alignment) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, received {type(dtype).__name__}")
    if split_alignment is not None and (not isinstance(split_alignment, int) or split_alignment <= 0):
        raise ValueError(f"split_alignment must be None or a positive int, received {split_alignment!r}")


_ALL: list = []


def _clear_all() -> None:
    for clear in _ALL:
        clear()


is_module_grouped_tensor_supported = _make_predicate(
    "is_module_grouped_tensor_supported",
    _module_rule,
    """Can a GroupedLinear module run its single-launch grouped path for these settings on ``device``?

    ``device``: pass the tensor's device (None = current device, costs a lookup).
    ``split_alignment``: a multiple that every split size is known to have (None = unknown).""",
)

is_op_fuser_grouped_tensor_supported = _make_predicate(
    "is_op_fuser_grouped_tensor_supported",
    _op_fuser_rule,
    """Can the op fuser's fused grouped MLP run its single-launch path (module rules + bf16 on CUDA)?""",
)
