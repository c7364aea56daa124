"""The one way te_dist defers an import: a module ``__getattr__`` that loads a name on first use.

Why: ``import te_dist`` must stay cheap and work without CUDA, Triton or megatron-core; the
subpackages (and megatron-core behind ``te_dist.megatron``) load when first asked for. Inside a
function, a plain local ``import`` with a comment saying why is the other accepted form.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Optional

__all__ = ["lazy_getattr"]


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
