"""te_dist: a distributed training integration layer for PyTorch Mixture-of-Experts.

Recipes (``te_dist.recipe``) describe quantization settings through a cached string; fusible
ops (``te_dist.ops``) turn op sequences into fusion plans keyed by that string; expert MLPs
(``te_dist.moe``) run on grouped GEMMs (``te_dist.kernels``) with tokens moved by all-to-all
(``te_dist.distributed``).

Importing this package never touches CUDA: subpackages load on first attribute access.
"""

import importlib

from . import recipe
from .autocast import autocast, get_active_recipe

__version__ = "0.1.0"

_LAZY_SUBMODULES = (
    "quantization",
    "ops",
    "support",
    "kernels",
    "distributed",
    "moe",
    "megatron",
    "cli",
)

__all__ = ["recipe", "autocast", "get_active_recipe", *_LAZY_SUBMODULES]


def __getattr__(name):
    # Lazy so that `import te_dist` stays cheap and CPU-safe; megatron is only imported when asked.
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'te_dist' has no attribute {name!r}")
