"""te_dist: a distributed training integration layer for PyTorch Mixture-of-Experts.

Recipes (``te_dist.recipe``) describe quantization settings through a cached string; fusible
ops (``te_dist.ops``) turn op sequences into fusion plans keyed by that string; expert MLPs
(``te_dist.moe``) run on grouped GEMMs (``te_dist.kernels``) with tokens moved by all-to-all
(``te_dist.distributed``). Every fast-path switch is a field of ``te_dist.settings``.

Importing this package never touches CUDA: subpackages load on first attribute access.
"""

from . import recipe
from .autocast import autocast, get_active_recipe
from .lazy_import import lazy_getattr

__version__ = "0.1.0"

_LAZY_SUBMODULES = (
    "settings",
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


# Lazy so that `import te_dist` stays cheap and CPU-safe; megatron is only imported when asked.
__getattr__ = lazy_getattr(__name__, globals(), dict.fromkeys(_LAZY_SUBMODULES))
