"""CUTLASS 3.x SM90 grouped-GEMM kernels for te_dist: sources, JIT build + disk cache, loader.

``grouped_gemm.cu`` is one source compiled per instance (direction x tile config x output dtype);
``build`` compiles an instance on first use and caches the .so on disk; ``heuristics`` picks the
tile config per problem shape. Nothing here touches CUDA or runs nvcc at import time.
"""

from . import fp8_block
from .heuristics import CONFIGS, choose_config
from .build import Instance, BuildError, build_instance, find_cutlass, find_nvcc, load

__all__ = ["CONFIGS", "choose_config", "Instance", "BuildError", "build_instance", "find_cutlass",
           "find_nvcc", "load"]
