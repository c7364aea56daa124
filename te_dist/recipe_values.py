"""Values a recipe holds beyond its declared settings, and their plain (YAML/JSON) form.

Why a module of its own: public attributes attached to a recipe are part of its identity
(``str(recipe)`` keys fusion plans and is agreed across ranks), so what may be attached, how a
typo is caught, and what ``from_dict`` may import are one policy, kept apart from the recipe
classes that use it.

* :func:`freeze` stores containers as read-only copies (:class:`FrozenDict`, :class:`FrozenList`,
  ``frozenset``, tuples): ``r.opts["a"] = 2`` raises instead of leaving the cached string stale.
  Values whose changes the string could not follow (tensors, plain objects, mutable dataclasses)
  are refused.
* :func:`near_miss` finds the declared name a new attribute name is one typo away from.
* :func:`to_plain` / :func:`from_plain`: callables travel as ``{"callable": "module:qualname"}``
  and attached formats as ``{"format": "E4M3"}``; reading one back imports nothing unless the
  caller allowed that callable (or opted in to imports).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import Iterable, Optional

__all__ = ["FrozenDict", "FrozenList", "freeze", "near_miss", "to_plain", "from_plain", "CallablePolicy"]

_READ_ONLY = (
    "a container attached to a recipe is read-only: an in-place change would not reach str(recipe) "
    "(the fusion key and the rank-consensus digest); assign a new value to the attribute instead"
)


def _read_only(self, *args, **kwargs):
    raise TypeError(_READ_ONLY)


class FrozenDict(dict):
    """A read-only dict (still a ``dict``: JSON, YAML and ``isinstance`` checks keep working)."""

    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self):
        return (FrozenDict, (dict(self),))


class FrozenList(list):
    """A read-only list (still a ``list``; renders as ``[...]`` like the list it copies)."""

    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = extend = insert = pop = remove = clear = sort = reverse = _read_only

    def __reduce__(self):
        return (FrozenList, (list(self),))


_SCALARS = (bool, int, float, complex, str, bytes, enum.Enum)


def freeze(value, where: str):
    """``value`` as stored on a recipe: containers copied read-only, immutable values as they are.

    ``where`` names the attribute (``"DelayedScaling.opts"``) in the error for a refused value.
    """
    if value is None or isinstance(value, _SCALARS):
        return value
    if isinstance(value, dict):
        return FrozenDict({freeze(k, where): freeze(v, where) for k, v in value.items()})
    if isinstance(value, list):
        return FrozenList(freeze(v, where) for v in value)
    if isinstance(value, tuple):
        items = [freeze(v, where) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # namedtuples keep their type
    if isinstance(value, (set, frozenset)):
        items = [freeze(v, where) for v in value]
        if isinstance(value, frozenset) and all(a is b for a, b in zip(items, value)):
            return value
        return frozenset(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        frozen = type(value).__dataclass_params__.frozen
        fields = [getattr(value, f.name) for f in dataclasses.fields(value)]
        if frozen and all(freeze(v, where) is v for v in fields):
            return value
        raise TypeError(
            f"{where}: a {type(value).__qualname__} can change after it is attached, and str(recipe) would not "
            "follow; attach a @dataclass(frozen=True) whose fields are immutable (tuples, not lists)"
        )
    if callable(value):  # functions and classes: identified by their qualified name
        return value
    raise TypeError(
        f"{where}: cannot attach a {type(value).__module__}.{type(value).__qualname__}: str(recipe) could not follow "
        "its changes; attach None, bool, int, float, str, an enum, a callable, a frozen dataclass, or "
        "lists, tuples, dicts and sets of these (stored as read-only copies)"
    )


def _distance(a: str, b: str) -> int:
    """Edit distance counting a swap of two neighbours as one edit (optimal string alignment)."""
    prev2, prev = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if prev2 is not None and i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[len(b)]


def near_miss(name: str, known: Iterable[str]) -> Optional[str]:
    """The known name ``name`` is a typo of (case aside, 1 edit up to 6 letters, else 2), or None."""
    lowered = name.lower()
    best, best_distance = None, None
    for candidate in known:
        if candidate == name:
            return None
        limit = 1 if len(candidate) <= 6 else 2
        d = _distance(lowered, candidate.lower())
        if d <= limit and (best_distance is None or d < best_distance):
            best, best_distance = candidate, d
    return best


# --------------------------------------------------------------------------- plain form


def qualified_name(fn) -> str:
    """``module:qualname`` of a callable (the form ``{"callable": ...}`` carries)."""
    return f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', '')}"


# Enums written as a one-key dict {tag: member name} and read back by that tag (te_dist.recipe
# registers its Format as "format"): this module never imports the recipe module, which imports it.
_TAGGED_ENUMS: dict = {}


def register_tagged_enum(tag: str, enum_type) -> None:
    """Write members of ``enum_type`` as ``{tag: name}`` and read that form back as the member."""
    _TAGGED_ENUMS[tag] = enum_type


def to_plain(value):
    """A JSON/YAML-friendly form of an attached value (read back by :func:`from_plain`)."""
    for tag, enum_type in _TAGGED_ENUMS.items():
        if isinstance(value, enum_type):
            return {tag: value.name}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if callable(value) and not isinstance(value, type):
        return {"callable": qualified_name(value)}
    return value


class CallablePolicy:
    """Which ``{"callable": "module:qualname"}`` entries ``from_dict`` may turn into objects.

    ``callables``: the objects a dict may name, matched by the ``module:qualname`` that
    ``to_dict`` writes, or a mapping from the names a config uses to the objects; nothing is
    imported. ``import_callables=True``: import any named callable (only for configs you trust:
    a config could name ``os:system``).
    """

    def __init__(self, callables: Iterable = (), import_callables: bool = False):
        if not isinstance(import_callables, bool):
            raise TypeError(f"import_callables must be a bool, got {type(import_callables).__name__}")
        named = callables.items() if isinstance(callables, dict) else ((qualified_name(fn), fn) for fn in callables)
        self.allowed = {}
        for name, fn in named:
            if not callable(fn):
                raise TypeError(f"callables must hold callables, got {type(fn).__name__} {fn!r}")
            self.allowed[name] = fn
        self.import_callables = import_callables

    def resolve(self, path, key: str):
        if not isinstance(path, str) or ":" not in path:
            raise ValueError(f"{key}: a callable is written as {{'callable': 'module:qualname'}}, got {path!r}")
        if path in self.allowed:
            return self.allowed[path]
        if not self.import_callables:
            raise ValueError(
                f"{key}: the recipe names the callable {path!r}, which is not allowed; pass it to "
                f"Recipe.from_dict(..., callables=[fn]) or opt in with import_callables=True (trusted configs only)"
            )
        module_name, _, qualname = path.partition(":")
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not callable(obj):
            raise ValueError(f"{key}: {path!r} is a {type(obj).__name__}, not a callable")
        return obj


def from_plain(value, key: str, policy: CallablePolicy):
    """Inverse of :func:`to_plain`: tagged dicts become callables and enum members (formats), containers recurse."""
    if isinstance(value, dict):
        if set(value) == {"callable"}:
            return policy.resolve(value["callable"], key)
        if len(value) == 1 and next(iter(value)) in _TAGGED_ENUMS:
            tag, name = next(iter(value.items()))
            enum_type = _TAGGED_ENUMS[tag]
            if name not in enum_type.__members__:
                raise ValueError(f"{key}: unknown {tag} {name!r}; expected one of {list(enum_type.__members__)}")
            return enum_type[name]
        return {k: from_plain(v, f"{key}.{k}", policy) for k, v in value.items()}
    if isinstance(value, list):
        return [from_plain(v, key, policy) for v in value]
    return value
