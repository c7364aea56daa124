"""Device-keyed, cached capability predicates for the grouped (single-launch) GEMM path.

Why cached: the predicates run on every fusible-op call, so a hit must cost about a dict lookup. Why device-keyed: the
answer depends on the device's compute capability (bf16 grouped on SM90+; MXFP8 / NVFP4 native only on SM100+; CPU
runs the reference path), so a result computed for one GPU is never reused for another. The key holds exactly the
recipe settings a check reads (not the recipe object, which is mutable), the dtype, the split alignment where the
check reads it, and the device. Nothing here reads split sizes from a GPU tensor (no host sync).

Rules (``cap`` = compute capability; CPU answers True for every recipe: the emulated reference
path keeps grouped semantics there):

| recipe | settings read | CUDA rule (module) |
|---|---|---|
| None | - | cap >= 9.0 and dtype bf16 |
| DelayedScaling, Float8CurrentScaling | fp8_format | cap == 9.0, FP8 grouped kernels available, dtype bf16/fp16, fp8_format != E5M2, split_alignment % 16 == 0 |
| Float8BlockScaling | fp8_format, x/w/grad_block_scaling_dim | cap == 9.0, FP8 grouped kernels available, fp8_format != E5M2, x and grad dims 1, w dim 2, split_alignment % 128 == 0 |
| MXFP8BlockScaling | fp8_format | cap >= 10.0, dtype bf16/fp16, fp8_format != E5M2, split_alignment % 32 == 0 |
| NVFP4BlockScaling | disable_2d_quantization | cap >= 10.0, dtype bf16, split_alignment % 16 == 0 (2D blocks) or % 32 == 0 (1D, ``disable_2d_quantization=True``) |

"FP8 grouped kernels available" (``fp8_kernels_why_not``, the one answer the rules, ``explain_path`` and the quantized
entry points read): cutlass_kernels' FP8 kernels can be built here (nvcc and the CUTLASS headers found), are not
turned off (``te_dist.settings.cutlass``, ``TE_DIST_DISABLE_CUTLASS``), none failed to load (a failure clears these
caches), and the device is SM 9.0 (they are built for sm_90a). The cached answers follow the settings: a predicate
drops them when the settings in force changed since they were filled (``te_dist.settings.generation``).

The op-fuser predicate (fused grouped MLP) additionally needs bf16 activations on CUDA.
``split_alignment=None`` means "unknown" and fails every rule that reads it (the None rule reads
none). A hit is one Python call and one C ``functools.lru_cache`` lookup: the recipe memoises the
settings the checks read as one interned key (``recipe._support_key``, reset on every public
attribute write); devices are keyed as passed, and forms naming the *current* device (None, "cuda",
an int) are resolved on every call, never stored (docs/kernels.md "Support predicates").
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import threading
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from . import recipe as _recipe
from . import settings as _settings

__all__ = ["is_module_grouped_tensor_supported", "is_op_fuser_grouped_tensor_supported", "CacheInfo",
           "set_capability_lookup", "set_fp8_kernels_lookup", "device_capability", "fp8_kernels_available",
           "cutlass_tools_present", "cutlass_disabled", "fp8_kernels_unavailable_reason", "fp8_kernels_why_not",
           "mark_fp8_kernels_unavailable", "clear_caches", "resolve_device", "native_split_alignment",
           "explain_path"]

CacheInfo = collections.namedtuple("CacheInfo", ["hits", "misses", "maxsize", "currsize"])


class _Spec(NamedTuple):
    tag: str  # "none" (no recipe) reads no setting nor the split alignment; every other rule reads both
    read: Callable  # recipe -> the settings this check reads (hashable; enums as their string value)


_SPECS = {
    type(None): _Spec("none", lambda _no_recipe: ()),
    _recipe.DelayedScaling: _Spec("fp8_tensor", operator.attrgetter("fp8_format._value_")),
    _recipe.Float8CurrentScaling: _Spec("fp8_tensor", operator.attrgetter("fp8_format._value_")),
    _recipe.Float8BlockScaling: _Spec("fp8_block", operator.attrgetter(
        "fp8_format._value_", "x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")),
    _recipe.MXFP8BlockScaling: _Spec("mxfp8", operator.attrgetter("fp8_format._value_")),
    _recipe.NVFP4BlockScaling: _Spec("nvfp4", operator.attrgetter("disable_2d_quantization")),
}


def _spec_for(recipe_obj) -> _Spec:
    for cls in type(recipe_obj).__mro__:  # subclasses use their base's rule
        spec = _SPECS.get(cls)
        if spec is not None:
            return spec
    raise TypeError(
        f"recipe must be None or a te_dist.recipe.Recipe of a known class, received {type(recipe_obj).__name__}"
    )


# --------------------------------------------------------------------------- settings keys


class _SettingsKey:
    """The settings one rule reads, interned: equal settings share one object, so a cache key
    hashes and compares it by identity (cheaper than hashing the settings on every hit)."""

    __slots__ = ("tag", "settings")

    def __init__(self, tag: str, settings):
        self.tag = tag
        self.settings = settings

    def __repr__(self) -> str:
        return f"_SettingsKey({self.tag!r}, {self.settings!r})"


_KEYS: dict = {}
_NONE_KEY = _SettingsKey("none", ())


def _memoised_key(recipe_obj) -> _SettingsKey:
    """The interned key of the settings ``recipe_obj``'s rule reads, memoised on the recipe (which
    resets it on any write)."""
    spec = _spec_for(recipe_obj)
    settings = spec.read(recipe_obj)
    key = _KEYS.setdefault((spec.tag, settings), _SettingsKey(spec.tag, settings))  # atomic
    object.__setattr__(recipe_obj, "_support_key", key)
    # A write racing with us lands its value before it resets the memo; if it landed between our
    # read and our store, the settings differ now and we drop the stale memo ourselves.
    if _spec_for(recipe_obj).read(recipe_obj) != key.settings:
        object.__setattr__(recipe_obj, "_support_key", None)
    return key


# --------------------------------------------------------------------------- devices


def _default_capability(device: torch.device) -> Optional[Tuple[int, int]]:
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _cached_capability(device: torch.device):
    return _lookups["capability"](device)


def device_capability(device) -> Optional[Tuple[int, int]]:
    """Cached compute capability of ``device`` (None for non-CUDA devices; None or an unindexed
    CUDA device means the current one). Every capability probe of the package goes through here,
    so ``set_capability_lookup`` fakes a GPU for all of them."""
    if not isinstance(device, torch.device) or device.index is None:  # (a CPU device resolves to itself)
        device = resolve_device(device)
    return _cached_capability(device)


_fp8_unavailable: list = []  # the reason the FP8 kernels cannot run here (set by their backend)


@functools.lru_cache(maxsize=None)
def cutlass_tools_present() -> bool:
    """nvcc and the CUTLASS headers are found, so cutlass_kernels can build (bf16 and FP8 alike)."""
    try:
        import cutlass_kernels  # a top-level package below te_dist: the sources and their build
    except ImportError:
        return False
    return cutlass_kernels.find_nvcc() is not None and cutlass_kernels.find_cutlass() is not None


def cutlass_disabled() -> bool:
    """Our bf16 and FP8 kernels are turned off (``te_dist.settings.cutlass`` False)."""
    return not _settings.current().cutlass


def fp8_kernels_unavailable_reason() -> str:
    """Why the FP8 grouped kernels cannot run here ("" when they can)."""
    if _fp8_unavailable:
        return _fp8_unavailable[0]
    if cutlass_disabled():
        return f"our kernels are turned off ({_settings.source('cutlass')})"
    return "" if cutlass_tools_present() else "nvcc or the CUTLASS headers are not found"


def mark_fp8_kernels_unavailable(reason: str) -> None:
    """Their backend reports a library that fails to load: every FP8 rule answers False from now on."""
    if not _fp8_unavailable:
        _fp8_unavailable.append(reason)
    _clear_all()


# What tests may replace (set_capability_lookup, set_fp8_kernels_lookup): the compute capability of
# a device, and whether the FP8 kernels can be built and loaded here.
_lookups = {"capability": _default_capability, "fp8_kernels": lambda: not fp8_kernels_unavailable_reason()}


@contextlib.contextmanager
def _installed(kind: str, fn: Callable):
    previous = _lookups[kind]
    _lookups[kind] = fn
    _clear_all()
    try:
        yield
    finally:
        _lookups[kind] = previous
        _clear_all()


def set_capability_lookup(fn: Callable):
    """Install ``fn(device) -> (major, minor) | None`` (tests inject fake GPUs); clears the caches."""
    return _installed("capability", fn)


def set_fp8_kernels_lookup(fn: Callable):
    """Install ``fn() -> bool`` for "FP8 grouped kernels available" (tests); clears the caches."""
    return _installed("fp8_kernels", fn)


def fp8_kernels_available() -> bool:
    """Can cutlass_kernels' FP8 grouped GEMMs be built and loaded here (via the installed lookup)?"""
    return bool(_lookups["fp8_kernels"]())


def _fp8_why_not_at(cap) -> Optional[str]:
    if cap is None:
        return "the FP8 grouped kernels need CUDA tensors"
    if cap != (9, 0):
        return f"the FP8 grouped kernels are built for sm_90a; this is sm_{cap[0]}{cap[1]}"
    if not fp8_kernels_available():
        return f"FP8 grouped kernels unavailable: {fp8_kernels_unavailable_reason() or 'lookup says no'}"
    return None


def fp8_kernels_why_not(device) -> Optional[str]:
    """None where cutlass_kernels' FP8 grouped GEMMs can run on ``device``, else why not: the one
    answer the FP8 rules, ``explain_path`` and the quantized entry points' decision all read."""
    device = device if isinstance(device, torch.device) else resolve_device(device)
    return _fp8_why_not_at(device_capability(device) if device.type == "cuda" else None)


def clear_caches() -> None:
    """Forget every cached answer (a kernel became unavailable, or a lookup changed). A change of
    ``te_dist.settings`` needs no call: the predicates notice it themselves."""
    _clear_all()


def _as_device(device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(f"device must be None, a torch.device, str or int, received {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device={device!r} does not name a device: {exc}") from None


def _names_current_device(device) -> bool:
    """True for forms whose meaning follows the current device (never cached as passed). Ints
    count too: 0 == 0.0 == False as cache keys, so storing them would let a float or a bool hit."""
    if device is None or isinstance(device, int):
        return True
    device = _as_device(device)
    return device.type == "cuda" and device.index is None


def resolve_device(device) -> torch.device:
    """Normalise ``device`` to an indexed torch.device; None means the current device (a lookup)."""
    device = _as_device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# --------------------------------------------------------------------------- rules

_LOW_PRECISION_ACT = (torch.bfloat16, torch.float16)
_FP8_FORMAT_NAMES = {"fp8_tensor": "per-tensor", "fp8_block": "block"}


def _sm(cap) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def _module_rule(tag: str, settings, dtype, split_alignment, cap) -> Optional[str]:
    """None where the single-launch grouped path runs (the module docstring's table), else why not: the one statement
    of the rules, which the predicates cache as ``is None`` and ``explain_path`` words for people."""
    if cap is None:  # CPU: reference (emulated) grouped path for every recipe
        return None if dtype in (torch.bfloat16, torch.float16, torch.float32) else f"no reference path for {dtype}"
    if tag == "none":
        return None if cap >= (9, 0) and dtype == torch.bfloat16 else (
            f"no single-launch grouped kernel for {dtype} on {_sm(cap)} (bf16 on SM 9.0+ only)")
    if tag in ("mxfp8", "nvfp4") and cap < (10, 0):
        return f"{tag.upper()} has no tensor-core path before SM 10.0 (this is {_sm(cap)})"
    if dtype not in _LOW_PRECISION_ACT or (tag == "nvfp4" and dtype != torch.bfloat16):
        return f"the grouped path takes bf16{'' if tag == 'nvfp4' else ' or fp16'} activations, received {dtype}"
    fmt = settings[0] if tag == "fp8_block" else settings
    if tag != "nvfp4" and fmt == _recipe.Format.E5M2.value:
        return "E5M2 for every operand has no kernel (use E4M3 or HYBRID)"
    if tag == "fp8_block" and settings[1:] != (1, 2, 1):
        return (f"the kernels take 1x128 activations/gradients and 128x128 weights (x/w/grad dims 1/2/1), "
                f"received {'/'.join(map(str, settings[1:]))}")
    # nvfp4: 16-row splits keep the 16x16 blocks of the wgrad operands inside one expert; the 1D
    # variant (disable_2d_quantization) quantizes those operands columnwise in 32-row tiles instead.
    multiple = (32 if settings else 16) if tag == "nvfp4" else _NATIVE_ALIGNMENT[tag]
    if split_alignment is None or split_alignment % multiple:
        return f"split alignment {split_alignment} is not a multiple of {multiple}"
    return _fp8_why_not_at(cap) if tag in _FP8_FORMAT_NAMES else None


_NATIVE_ALIGNMENT = {"fp8_tensor": 16, "fp8_block": 128, "mxfp8": 32, "nvfp4": 32}


def native_split_alignment(recipe) -> Optional[int]:
    """The split alignment the native grouped path of ``recipe`` needs (rows per group a multiple
    of it), or None when it needs none (no recipe). A dispatcher pads each expert's rows to it."""
    if recipe is None:
        return None
    return _NATIVE_ALIGNMENT.get(_spec_for(recipe).tag)


def _op_fuser_rule(tag, settings, dtype, split_alignment, cap) -> Optional[str]:
    if cap is not None and dtype != torch.bfloat16:
        return f"the fused grouped MLP takes bf16 activations natively, received {dtype}"
    return _module_rule(tag, settings, dtype, split_alignment, cap)


def _check_args(dtype, split_alignment) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, received {type(dtype).__name__}")
    if split_alignment is not None and (not isinstance(split_alignment, int) or split_alignment <= 0):
        raise ValueError(f"split_alignment must be None or a positive int, received {split_alignment!r}")


# --------------------------------------------------------------------------- cached predicates


class _Answer(Exception):
    """Raised by a cache miss whose device form names the current device: carries the answer (its
    one argument) out of the lru_cache without storing the raw form (lru_cache never stores exceptions)."""


def _make_predicate(name: str, rule: Callable, doc: str):
    """Build a predicate whose hit costs one Python call, one memo read and one C lru_cache lookup."""
    resolved_lock = threading.Lock()
    num_resolved = 0  # raw misses of current-device forms: each also did a lookup of its own

    def compute(key: _SettingsKey, dtype, split_alignment, device) -> bool:
        nonlocal num_resolved
        _check_args(dtype, split_alignment)
        if _names_current_device(device):
            with resolved_lock:
                num_resolved += 1
            dev = resolve_device(device)
            raise _Answer(lookup(key, dtype, split_alignment, dev))
        return rule(key.tag, key.settings, dtype, split_alignment, _lookups["capability"](_as_device(device))) is None

    lookup = functools.lru_cache(maxsize=None)(compute)  # (settings key, dtype, alignment, device)

    def predicate(recipe, dtype, *, split_alignment=None, device=None) -> bool:
        if _filled_under[0] != _settings.generation:  # the settings changed since the answers were cached
            _follow_settings()
        try:
            if recipe is None:  # reads no setting nor the alignment: one entry per dtype and device
                return lookup(_NONE_KEY, dtype, None, device)
            key = recipe._support_key
            if key is None:  # first call, or a setting was written since
                key = _memoised_key(recipe)
            return lookup(key, dtype, split_alignment, device)
        except _Answer as current_device_answer:
            return current_device_answer.args[0]
        except (AttributeError, TypeError):
            # not a recipe, or an unhashable argument: the uncached path raises the precise error
            return uncached(recipe, dtype, split_alignment=split_alignment, device=device)

    def uncached(recipe, dtype, *, split_alignment=None, device=None) -> bool:
        spec = _spec_for(recipe)
        _check_args(dtype, split_alignment)
        dev = resolve_device(device)
        return rule(spec.tag, spec.read(recipe), dtype, split_alignment if spec.tag != "none" else None,
                    _lookups["capability"](dev)) is None

    def cache_info() -> CacheInfo:
        """Hits and misses count each call once; currsize counts (settings, dtype, alignment, device) entries."""
        with resolved_lock:
            info = lookup.cache_info()
            return CacheInfo(info.hits, info.misses - num_resolved, None, info.currsize)

    def cache_clear() -> None:
        nonlocal num_resolved
        with resolved_lock:
            lookup.cache_clear()
            num_resolved = 0

    predicate.__name__ = predicate.__qualname__ = name
    predicate.__doc__ = doc
    predicate.__wrapped__ = uncached
    predicate.cache_info = cache_info
    predicate.cache_clear = cache_clear
    _ALL.append(cache_clear)
    return predicate


_ALL: list = []
generation = 0  # changes whenever the cached answers are dropped: a cache outside this module keys on it
_filled_under = [-1]  # the settings generation the cached answers were computed under


def _follow_settings() -> None:
    _settings.current()  # the first call reads the environment
    generation = _settings.generation
    _clear_all()
    _filled_under[0] = generation


def _clear_all() -> None:
    global generation
    generation += 1
    _cached_capability.cache_clear()
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


def explain_path(recipe, dtype, *, device=None) -> Tuple[str, str]:
    """("native" | "emulated" | "split", why) for a fused grouped-MLP call under ``recipe`` with
    ``dtype`` activations on ``device``, splits aligned as MoELayer pads them. For people
    (``te-dist env``), not the hot path: the op-fuser rule's own reason, uncached."""
    spec = _spec_for(recipe)
    dev = resolve_device(device)
    cap = _lookups["capability"](dev)
    if cap is None:
        return ("emulated" if spec.tag != "none" else "split"), f"{dev.type}: the float32 reference path"
    alignment = native_split_alignment(recipe)
    why = _op_fuser_rule(spec.tag, spec.read(recipe), dtype, alignment, cap)
    if why is not None:
        return ("split" if spec.tag == "none" else "emulated"), why
    if spec.tag == "none":
        return "native", "torch._grouped_mm (CUTLASS SM90 where an epilogue is fused or measured faster)"
    if spec.tag not in _FP8_FORMAT_NAMES:
        return "native", f"{type(recipe).__name__} grouped path, expert rows padded to {alignment}"
    return "native", (f"CUTLASS SM90 FP8 grouped GEMMs ({_FP8_FORMAT_NAMES[spec.tag]} scales; cuBLAS per expert where "
                      f"each expert's GEMM is large), expert rows padded to {alignment}")
