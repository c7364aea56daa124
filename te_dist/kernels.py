"""The public entry of the grouped GEMM (``te_dist.gemm`` holds it; see that package's docstring)."""

from .gemm import *  # noqa: F401,F403
from .gemm import __all__  # noqa: F401
