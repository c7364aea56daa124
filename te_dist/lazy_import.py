"""The one way te_dist defers an import: a module ``__getattr__`` that loads a name on first use.

Why: ``import te_dist`` must stay cheap and work without CUDA, Triton or megatron-core; the
subpackages (and megatron-core behind ``te_dist.megatron``) load when first asked for. Inside a
function, a plain local ``import`` with a comment saying why is the other accepted form.
:func:`optional_module` is for a module that may not import at all (a Triton kernel file on a
machine without Triton): its callers fall back to another implementation.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Callable, Dict, Optional

__all__ = ["lazy_getattr", "optional_module"]


def lazy_getattr(package: str, namespace: dict, names: Dict[str, Optional[str]]) -> Callable[[str], object]:
    """A ``__getattr__`` for ``package`` (whose globals are ``namespace``): ``names`` maps a public
    name to the relative module that defines it, or to None where the name is itself a submodule
    (``".ops"``). The loaded value is cached in ``namespace``, so each name imports once."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name = names[name]
        if module_name is None:
            value = importlib.import_module(f".{name}", package)
        else:
            value = getattr(importlib.import_module(module_name, package), name)
        namespace[name] = value
        return value

    return __getattr__


_optional: Dict[tuple, Optional[ModuleType]] = {}


def optional_module(name: str, package: str, what: str, fallback: str) -> Optional[ModuleType]:
    """The module ``name`` (relative to ``package``), imported on the first call; None where it does
    not import (no Triton on CI, a broken install), with one warning that ``what`` is unavailable and
    ``fallback`` serves instead. One import attempt per module and process."""
    key = (name, package)
    if key not in _optional:
        try:
            module = importlib.import_module(name, package)
        except Exception as exc:  # ImportError without Triton; anything else is a broken install
            module = None
            warnings.warn(f"{what} unavailable ({exc!r:.200}); using {fallback}", stacklevel=3)
        _optional[key] = module
    return _optional[key]
