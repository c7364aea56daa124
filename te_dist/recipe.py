"""Quantization recipes: plain, mutable Python objects that describe their own settings.

Why a cached string: every fusible-op call keys its fusion plan on ``str(recipe)``, so reading it
must cost about as much as an attribute read, yet it must never be stale. The string is built
once and dropped on ANY public attribute write or delete (declared settings and public attributes
attached later alike), then rebuilt on the next read.

One list of settings per class (``_SETTINGS``) drives construction, validation, the string,
equality, hashing, ``to_dict`` and pickling, so none of them can drift apart.

Public attributes attached after construction are part of the recipe too, so three guards keep
them honest: a name one typo away from a declared setting (``margn``) raises instead of attaching;
containers are stored as read-only copies (an in-place edit could not reach the cached string);
values whose changes the string could not follow (tensors, plain objects) are refused.
``from_dict`` never imports a callable the caller did not allow.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Iterable, Optional

from .recipe_values import (
    CallablePolicy,
    FrozenDict,
    FrozenList,
    freeze,
    from_plain,
    near_miss,
    register_tagged_enum,
    to_plain,
)

__all__ = [
    "Format",
    "QParams",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "RECIPE_NAMES",
    "recipe_from_name",
    "FrozenDict",
    "FrozenList",
]


class Format(enum.Enum):
    """Element formats. HYBRID means E4M3 in the forward pass and E5M2 for gradients."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"
    E2M1 = "E2M1"

    @property
    def forward(self) -> "Format":
        return Format.E4M3 if self is Format.HYBRID else self

    @property
    def backward(self) -> "Format":
        return Format.E5M2 if self is Format.HYBRID else self

    def for_role(self, role: str) -> "Format":
        """The concrete format used for an operand role ("input", "weight", "grad_output")."""
        return self.backward if role == "grad_output" else self.forward

    @property
    def max(self) -> float:
        """Largest finite value of a concrete format."""
        if self is Format.HYBRID:
            raise ValueError("Format.HYBRID is not a concrete format; use .forward or .backward")
        return _FORMAT_MAX[self]

    def __repr__(self) -> str:
        return f"Format.{self.name}"


_FORMAT_MAX = {Format.E4M3: 448.0, Format.E5M2: 57344.0, Format.E2M1: 6.0}
register_tagged_enum("format", Format)  # to_dict writes {"format": "E4M3"}; from_dict reads it back

BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


@dataclasses.dataclass(frozen=True)
class QParams:
    """Per-role NVFP4 quantization parameters, derived from an NVFP4BlockScaling recipe."""

    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Setting:
    """One declared recipe setting: its name, default and validator (raises on a bad value)."""

    name: str
    default: Any
    check: Callable[[str, str, Any], None]
    doc: str = ""
    parse: Optional[Callable[[str, Any], Any]] = None  # plain (YAML/JSON) value -> setting value, for from_dict


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_nonneg_int(cls_name, name, value):
    if not _is_int(value):
        raise TypeError(f"{cls_name}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{cls_name}.{name} must be >= 0, got {value}")


def _check_positive_int(cls_name, name, value):
    if not _is_int(value):
        raise TypeError(f"{cls_name}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{cls_name}.{name} must be >= 1, got {value}")


def _check_bool(cls_name, name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{cls_name}.{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_block_dim(cls_name, name, value):
    if not _is_int(value) or value not in (1, 2):
        raise ValueError(f"{cls_name}.{name} must be 1 (1x128 blocks) or 2 (128x128 blocks), got {value!r}")


def _check_backward_override(cls_name, name, value):
    if value not in BACKWARD_OVERRIDES:
        raise ValueError(f"{cls_name}.{name} must be one of {BACKWARD_OVERRIDES}, got {value!r}")


def _check_amax_algo(cls_name, name, value):
    if callable(value):
        return
    if value not in ("max", "most_recent"):
        raise ValueError(f"{cls_name}.{name} must be 'max', 'most_recent' or a callable, got {value!r}")


def _format_check(*allowed: Format):
    def check(cls_name, name, value):
        if not isinstance(value, Format):
            raise TypeError(f"{cls_name}.{name} must be a te_dist.recipe.Format, got {type(value).__name__} {value!r}")
        if value not in allowed:
            names = ", ".join(f.name for f in allowed)
            raise ValueError(f"{cls_name}.{name} must be one of {names}, got {value.name}")

    return check


def _parse_format(name, value):
    if not isinstance(value, str):
        return value  # the validator reports the type
    try:
        return Format[value]
    except KeyError:
        raise ValueError(f"{name}: unknown format {value!r}; expected one of {[f.name for f in Format]}") from None


def _format_setting(name: str, default: Format, allowed: tuple, doc: str = "") -> Setting:
    """A declared format setting: the only settings ``from_dict`` turns from a name into a Format."""
    return Setting(name, default, _format_check(*allowed), doc, parse=_parse_format)


def _backward_override_setting() -> Setting:
    return Setting(
        "backward_override",
        None,
        _check_backward_override,
        "None: quantize backward GEMM operands too; 'high_precision': backward GEMMs in the activation dtype; "
        "'dequantized': backward GEMMs reuse the dequantized forward operands, gradients unquantized",
    )


# --------------------------------------------------------------------------- string form


def _describe(value) -> str:
    """A deterministic, address-free rendering of a setting value (stable across processes)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        items = sorted((_describe(k), _describe(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_describe(v) for v in value)) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={_describe(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    if callable(value):
        return _qualified_name(value)
    text = repr(value)
    if " at 0x" in text:  # default object repr: carries an address, which differs per process
        return f"<{type(value).__module__}.{type(value).__qualname__}>"
    return text


def _qualified_name(fn) -> str:
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}"


# --------------------------------------------------------------------------- base class

_STR_CACHE = "_str_cache"
# Memos derived from the public settings: every public attribute write or delete resets them to
# None (after the write), and pickling drops them. ``_support_key`` holds the settings that
# te_dist.support's predicates read (filled there), so a cached support answer never outlives a
# settings change.
_MEMOS = (_STR_CACHE, "_support_key")


class Recipe:
    """Base class of all recipes.

    Subclasses declare ``_SETTINGS`` (a tuple of :class:`Setting`) and may override ``_derive``
    (recompute derived attributes) and ``_check_combination`` (cross-setting rules). Public
    attributes attached after construction become part of the recipe's identity (its string,
    equality and dict form); attributes with a leading underscore are private state.
    """

    _SETTINGS: tuple = ()
    NAME: str = ""
    _support_key = None  # memo (see _MEMOS); the class default covers objects unpickled from old state

    def __init__(self, **kwargs):
        cls_name = type(self).__name__
        declared = {s.name: s for s in self._SETTINGS}
        unknown = sorted(set(kwargs) - set(declared))
        if unknown:
            allowed = ", ".join(declared)
            hints = [f"{near_miss(name, declared)!r} for {name!r}" for name in unknown if near_miss(name, declared)]
            hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
            raise TypeError(f"{cls_name} got unexpected keyword(s) {unknown}{hint}; allowed settings: {allowed}")
        values = {s.name: kwargs.get(s.name, s.default) for s in self._SETTINGS}
        for name, value in values.items():
            declared[name].check(cls_name, name, value)
        self._check_combination(values)
        self._reset_memos()
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._derive()

    # -- identity -------------------------------------------------------------------------
    def settings(self) -> dict:
        """All public settings: declared ones in declaration order, then attached ones by name."""
        state = self.__dict__
        out = {s.name: state[s.name] for s in self._SETTINGS}
        extra = sorted(k for k in state if not k.startswith("_") and k not in out)
        for key in extra:
            out[key] = state[key]
        return out

    def describe_settings(self) -> dict:
        """Each public setting as the deterministic text ``str(recipe)`` shows for it (for diffs across ranks)."""
        return {name: _describe(value) for name, value in self.settings().items()}

    def __str__(self) -> str:
        cached = self._str_cache
        if cached is None:
            cached = self._build_string()
            object.__setattr__(self, _STR_CACHE, cached)
        return cached

    __repr__ = __str__

    def _build_string(self) -> str:
        body = ", ".join(f"{k}={v}" for k, v in self.describe_settings().items())
        return f"{type(self).__name__}({body})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, Recipe):
            return NotImplemented
        return type(self) is type(other) and str(self) == str(other)

    def __hash__(self) -> int:
        # Recipes are mutable on purpose; the hash follows the current settings like the string.
        return hash(str(self))

    # -- mutation -------------------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if isinstance(getattr(type(self), name, None), property):
            raise AttributeError(
                f"{type(self).__name__}.{name} is derived from other settings and cannot be written"
            )
        setting = self._setting(name)
        if setting is not None:
            setting.check(type(self).__name__, name, value)
            proposed = {s.name: self.__dict__[s.name] for s in self._SETTINGS}
            proposed[name] = value
            self._check_combination(proposed)  # raises before anything is written
        else:
            value = self._attachable(name, value)
        object.__setattr__(self, name, value)
        self._reset_memos()
        if setting is not None:
            self._derive()

    def __delattr__(self, name: str) -> None:
        if self._setting(name) is not None:
            raise AttributeError(f"cannot delete declared setting {type(self).__name__}.{name}; assign a value instead")
        object.__delattr__(self, name)
        if not name.startswith("_"):
            self._reset_memos()

    def _attachable(self, name: str, value):
        """``value`` as stored under a new public attribute ``name`` (raises for a typo or a mutable value)."""
        cls = type(self)
        if name not in self.__dict__:  # re-assigning an attached attribute was checked when it was attached
            known = [s.name for s in cls._SETTINGS]
            known += [n for n in dir(cls) if not n.startswith("_") and isinstance(getattr(cls, n), property)]
            typo_of = near_miss(name, known)
            if typo_of is not None:
                raise AttributeError(
                    f"{cls.__name__} has no setting {name!r}; did you mean {typo_of!r}? (public attributes attached "
                    f"to a recipe become part of its key, so a name this close to a setting is refused)"
                )
        return freeze(value, f"{cls.__name__}.{name}")

    def _reset_memos(self) -> None:
        for memo in _MEMOS:
            object.__setattr__(self, memo, None)

    @classmethod
    def _setting(cls, name: str) -> Optional[Setting]:
        for s in cls._SETTINGS:
            if s.name == name:
                return s
        return None

    def _derive(self) -> None:
        """Recompute attributes derived from settings (none by default)."""

    def _check_combination(self, values: dict) -> None:
        """Reject impossible combinations of settings (none by default)."""

    # -- copying and serialisation ---------------------------------------------------------
    def __getstate__(self):
        state = dict(self.__dict__)
        for memo in _MEMOS:
            state[memo] = None
        return state

    def __setstate__(self, state):
        declared = {s.name for s in self._SETTINGS}
        for key, value in state.items():
            if not key.startswith("_") and key not in declared:
                value = freeze(value, f"{type(self).__name__}.{key}")  # state pickled before attributes were frozen
            object.__setattr__(self, key, value)

    def to_dict(self) -> dict:
        """A JSON/YAML-friendly description: ``{"type": class name, setting: value, ...}``."""
        out = {"type": type(self).__name__}
        for key, value in self.settings().items():
            declared_format = isinstance(value, Format) and self._setting(key) is not None
            out[key] = value.name if declared_format else to_plain(value)
        return out

    @staticmethod
    def from_dict(data: dict, *, callables: Iterable = (), import_callables: bool = False) -> "Recipe":
        """Inverse of :meth:`to_dict`; unknown declared keys raise, extra public keys are attached.

        A ``{"callable": "module:qualname"}`` entry resolves only to one of ``callables`` (matched by
        qualified name, nothing imported) unless ``import_callables=True``: a config file must not be
        able to name ``os:system``. Only declared format settings read a name (``"E4M3"``) as a Format.
        """
        policy = CallablePolicy(callables, import_callables)
        if not isinstance(data, dict) or "type" not in data:
            raise ValueError(f"a recipe dict needs a 'type' key naming one of {sorted(_RECIPE_CLASSES)}, got {data!r}")
        data = dict(data)
        type_name = data.pop("type")
        cls = _RECIPE_CLASSES.get(type_name)
        if cls is None:
            raise ValueError(f"unknown recipe type {type_name!r}; expected one of {sorted(_RECIPE_CLASSES)}")
        kwargs = {}
        for key, value in data.items():
            setting = cls._setting(key)
            if setting is not None:
                kwargs[key] = setting.parse(key, value) if setting.parse else from_plain(value, key, policy)
        extra = {}
        for key, value in data.items():
            if key in kwargs:
                continue
            if key.startswith("_"):
                raise ValueError(f"recipe dict key {key!r}: private attributes cannot be set from a dict")
            extra[key] = from_plain(value, key, policy)  # every callable is checked before anything is built
        recipe = cls(**kwargs)
        for key, value in extra.items():
            try:
                setattr(recipe, key, value)
            except AttributeError as exc:  # a near-miss of a setting: a config error, like an unknown keyword
                raise ValueError(f"recipe dict key {key!r}: {exc}") from None
        return recipe


# --------------------------------------------------------------------------- recipes


class DelayedScaling(Recipe):
    """Per-tensor FP8 whose scale comes from a history of past amax values (one step behind)."""

    NAME = "delayed"
    _SETTINGS = (
        Setting("margin", 0, _check_nonneg_int, "scale = fp8_max / amax / 2**margin"),
        _format_setting("fp8_format", Format.HYBRID, (Format.E4M3, Format.E5M2, Format.HYBRID)),
        Setting("amax_history_len", 1024, _check_positive_int, "number of past amax values kept"),
        Setting("amax_compute_algo", "max", _check_amax_algo, "'max' | 'most_recent' | callable(history)->amax"),
        Setting("reduce_amax", True, _check_bool, "all-reduce (MAX) amax over the process group"),
        _backward_override_setting(),
    )


class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 whose scale comes from the current tensor's amax."""

    NAME = "current"
    _SETTINGS = (
        _format_setting("fp8_format", Format.HYBRID, (Format.E4M3, Format.E5M2, Format.HYBRID)),
        Setting("use_power_2_scales", False, _check_bool, "round scales down to a power of two"),
        _backward_override_setting(),
    )


class Float8BlockScaling(Recipe):
    """FP8 with one scale per 1x128 (dim 1) or 128x128 (dim 2) block, as DeepSeek-V3 trains."""

    NAME = "block"
    _SETTINGS = (
        _format_setting("fp8_format", Format.E4M3, (Format.E4M3, Format.HYBRID)),
        Setting("x_block_scaling_dim", 1, _check_block_dim, "input blocks"),
        Setting("w_block_scaling_dim", 2, _check_block_dim, "weight blocks"),
        Setting("grad_block_scaling_dim", 1, _check_block_dim, "grad_output blocks"),
        Setting("use_power_2_scales", True, _check_bool, "round scales down to a power of two"),
        _backward_override_setting(),
    )

    def _check_combination(self, values: dict) -> None:
        if values["x_block_scaling_dim"] == 2 and values["grad_block_scaling_dim"] == 2:
            raise ValueError(
                "Float8BlockScaling: x_block_scaling_dim=2 with grad_block_scaling_dim=2 would need a "
                "128x128 by 128x128 block GEMM (wgrad), which no kernel provides; set one of them to 1"
            )


class MXFP8BlockScaling(Recipe):
    """OCP MX FP8: 32-element blocks sharing an E8M0 (power-of-two) exponent."""

    NAME = "mxfp8"
    _SETTINGS = (
        Setting("margin", 0, _check_nonneg_int, "shared exponent lowered by margin"),
        _format_setting("fp8_format", Format.E4M3, (Format.E4M3, Format.E5M2, Format.HYBRID)),
        _backward_override_setting(),
    )


class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 elements, 16-element blocks with E4M3 scales and one fp32 tensor scale.

    The per-role ``QParams`` are derived from the three ``disable_*`` switches and recomputed
    whenever one is written, so they can never go stale.
    """

    NAME = "nvfp4"
    _SETTINGS = (
        Setting("disable_rht", False, _check_bool, "skip the random Hadamard transform on wgrad operands"),
        Setting("disable_stochastic_rounding", False, _check_bool, "round gradients to nearest"),
        Setting("disable_2d_quantization", False, _check_bool, "1x16 instead of 16x16 weight blocks"),
        _backward_override_setting(),
    )

    def _derive(self) -> None:
        self._fp4_quant_fwd_inp = QParams(random_hadamard_transform=not self.disable_rht)
        self._fp4_quant_fwd_weight = QParams(fp4_2d_quantization=not self.disable_2d_quantization)
        self._fp4_quant_bwd_grad = QParams(
            random_hadamard_transform=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding,
        )

    @property
    def fp4_quant_fwd_inp(self) -> QParams:
        """Input: RHT applies to its columnwise (wgrad) copy only."""
        return self._fp4_quant_fwd_inp

    @property
    def fp4_quant_fwd_weight(self) -> QParams:
        return self._fp4_quant_fwd_weight

    @property
    def fp4_quant_bwd_grad(self) -> QParams:
        """grad_output: RHT on its columnwise (wgrad) copy, stochastic rounding."""
        return self._fp4_quant_bwd_grad


_RECIPE_CLASSES = {
    cls.__name__: cls
    for cls in (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)
}
RECIPE_NAMES = ("none",) + tuple(cls.NAME for cls in _RECIPE_CLASSES.values())


def recipe_from_name(name: str, **overrides) -> Optional[Recipe]:
    """Build a recipe from a short name (``"none"`` gives None), e.g. for ``--recipe`` flags."""
    if name == "none":
        if overrides:
            raise ValueError(f"recipe 'none' takes no settings, got {sorted(overrides)}")
        return None
    for cls in _RECIPE_CLASSES.values():
        if cls.NAME == name:
            return cls(**overrides)
    raise ValueError(f"unknown recipe name {name!r}; expected one of {RECIPE_NAMES}")
