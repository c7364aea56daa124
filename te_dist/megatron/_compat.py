"""Which megatron-core is installed, and the few names whose home moved between releases.

Why one file: 0.16.x (Python 3.11 wheels) and 0.19.x (the GPU machines) build experts differently
(0.16: ``build_module(spec, n, config, pg_collection=...)``; 0.19: ``spec(n, config,
pg_collection=..., name=...)`` with MoE specs held in ``functools.partial``). Everything that
depends on the release is decided here, so the rest of ``te_dist.megatron`` reads the same for both.
"""

from __future__ import annotations

import functools
import importlib

__all__ = ["SUPPORTED_RANGE", "megatron_version", "require_megatron", "define_missing_te_general_gemm"]

SUPPORTED_RANGE = ((0, 16), (0, 20))  # [lower, upper): what setup.cfg's `megatron` extra allows


@functools.lru_cache(maxsize=None)
def megatron_version() -> tuple:
    """``(major, minor, patch)`` of the installed megatron-core; ImportError naming the extra if absent."""
    try:
        package_info = importlib.import_module("megatron.core.package_info")
    except ImportError as err:  # the extra is optional: say how to get it
        raise ImportError(
            "te_dist.megatron needs megatron-core (0.16.x or 0.19.x): pip install 'te_dist[megatron]'"
        ) from err
    return tuple(int(part) for part in package_info.__shortversion__.split(".")[:3])


def require_megatron() -> tuple:
    """Check the installed release is one we support; return its version."""
    version = megatron_version()
    low, high = SUPPORTED_RANGE
    if not (low <= version[:2] < high):
        raise ImportError(
            f"te_dist.megatron supports megatron-core >= {low[0]}.{low[1]}, < {high[0]}.{high[1]}; "
            f"found {'.'.join(map(str, version))}"
        )
    return version


def define_missing_te_general_gemm() -> None:
    """Give megatron-core 0.16.x's router the ``te_general_gemm = None`` it expects without TransformerEngine.

    Why: 0.16's ``moe_utils`` binds ``te_general_gemm`` only when TransformerEngine imports, yet its
    router GEMM (``RouterGatingLinearFunction``, forward and backward) reads the name unguarded and
    takes its torch GEMM when it is None: a ``NameError`` on any machine without TransformerEngine.
    Later releases bind it to None in that case; this does the same where the name is missing, and
    changes nothing where it exists. Megatron's installed files are not touched.
    """
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None
