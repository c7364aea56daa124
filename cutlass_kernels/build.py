"""Just-in-time build of the CUDA sources (grouped_gemm.cu instances and plain sources), cached on
disk, loaded with ctypes.

Cache key (sha256, ``_entry``): the source, the headers beside it that it includes, arch, flags and the nvcc
version; for an instance of a CUTLASS source also ``SHARED_HEADERS``, every CUTLASS header (the
whole include tree, hashed once per process), the instance macros and the CUTLASS version. The disk
cache itself (whole-or-absent entries, one build per key across processes, a broken entry rebuilt
once) is ``cache.py``. Cache dir: ``$TE_DIST_CACHE`` or ``~/.cache/te_dist/kernels``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .cache import BuildError, build_cached, entry_is_whole, open_cached
from .heuristics import CONFIGS

__all__ = ["ARCH_FLAGS", "BASE_FLAGS", "DEVICE_FLAGS", "KINDS", "SCHEDULES", "SOURCE", "Instance", "BuildError",
           "GemmLibrary", "Libraries", "cache_dir", "find_nvcc", "find_cutlass",
           "build_instance", "build_cutlass_source", "open_cutlass_source", "build_plain_source", "open_plain_source",
           "load", "all_instances", "is_built"]

SOURCE = Path(__file__).resolve().parent / "grouped_gemm.cu"
# included by grouped_gemm.cu and fp8_block_gemm.cu: part of every instance's cache key
SHARED_HEADERS = (Path(__file__).resolve().parent / "grouped_launch.cuh",)
ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)
DEVICE_FLAGS = ("-std=c++17", "-DNDEBUG", "--expt-relaxed-constexpr", "-O3")
BASE_FLAGS = DEVICE_FLAGS + ("-Xcompiler", "-fPIC", "-shared", "-lineinfo")

KINDS = {"fwd": 0, "dgrad": 1, "wgrad": 2}  # TE_GG_KIND / TE_FB_KIND of each direction
SCHEDULES = {"cooperative": 0, "pingpong": 1, "cooperative_fast": 2, "pingpong_fast": 3}  # TE_GG/FB_SCHEDULE; _fast: FP8


@dataclasses.dataclass(frozen=True)
class Instance:
    direction: str  # "fwd" | "dgrad" | "wgrad"
    config: int  # heuristics.CONFIGS key
    out_f32: bool = False

    def __post_init__(self):
        if self.direction not in KINDS:
            raise ValueError(f"direction must be one of {tuple(KINDS)}, received {self.direction!r}")
        if self.config not in CONFIGS:
            raise ValueError(f"config must be one of {sorted(CONFIGS)}, received {self.config!r}")

    @property
    def name(self) -> str:
        return f"te_gg_{self.direction}_c{self.config}_{'f32' if self.out_f32 else 'bf16'}"

    @property
    def macros(self) -> Tuple[str, ...]:
        schedule, tile_m, tile_n, tile_k, (cluster_m, cluster_n) = CONFIGS[self.config]
        return (f"-DTE_GG_KIND={KINDS[self.direction]}", f"-DTE_GG_CONFIG={self.config}",
                f"-DTE_GG_OUT_F32={int(self.out_f32)}", f"-DTE_GG_SCHEDULE={SCHEDULES[schedule]}",
                f"-DTE_GG_TILE_M={tile_m}", f"-DTE_GG_TILE_N={tile_n}", f"-DTE_GG_TILE_K={tile_k}",
                f"-DTE_GG_CLUSTER_M={cluster_m}", f"-DTE_GG_CLUSTER_N={cluster_n}")


def all_instances() -> List[Instance]:
    return [Instance(d, c, f) for d in KINDS for c in sorted(CONFIGS) for f in (False, True)]


def cache_dir() -> Path:
    return Path(os.environ.get("TE_DIST_CACHE") or Path.home() / ".cache" / "te_dist" / "kernels")


@functools.lru_cache(maxsize=None)
def find_nvcc() -> Optional[str]:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


@functools.lru_cache(maxsize=None)
def find_cutlass() -> Optional[Tuple[Path, Path, str]]:
    """(include dir, util include dir, version) from $TE_DIST_CUTLASS_DIR or the nvidia-cutlass wheel."""
    root = os.environ.get("TE_DIST_CUTLASS_DIR")
    version = "custom"
    if not root:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or spec.origin is None:
            return None
        root = str(Path(spec.origin).parent / "source")
        try:
            from importlib.metadata import version as _v

            version = _v("nvidia-cutlass")
        except Exception:  # metadata missing: the header hash still keys the cache
            version = "unknown"
    include = Path(root) / "include"
    util = Path(root) / "tools" / "util" / "include"
    if not (include / "cutlass" / "cutlass.h").exists():
        return None
    return include, util, version


@functools.lru_cache(maxsize=None)
def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in (".h", ".hpp", ".cuh", ".inl", ".inc"):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _digest(*parts: bytes) -> str:
    """Short sha256 of the parts, each terminated so that no two part lists collide."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def build_instance(inst: Instance, *, verbose: bool = False) -> Path:
    """Path of the cached .so for ``inst``, compiling it first if needed."""
    return build_cutlass_source(SOURCE, inst.name, inst.macros, verbose=verbose)


def _entry(source: Path, name: str, macros=None, flags: Sequence[str] = BASE_FLAGS):
    """(cache target, compile command) of one library: an instance of a CUTLASS source (``macros``: its
    -D flags; its key also covers the shared headers, every CUTLASS header and the CUTLASS version) or,
    with ``macros`` None, a plain CUDA source (its key: also its quoted includes beside it)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    names = [] if macros is not None else re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(), flags=re.M)
    headers, includes, version = [p.read_bytes() for p in map(source.with_name, names) if p.is_file()], [], []
    if macros is not None:
        cut = find_cutlass()
        if cut is None:
            raise BuildError("CUTLASS headers not found (pip install --no-deps nvidia-cutlass, or set "
                             "TE_DIST_CUTLASS_DIR)")
        include, util, cutlass_version = cut
        headers = [h.read_bytes() for h in SHARED_HEADERS] + [_tree_digest(d).encode() for d in (include, util)]
        includes, version = [f"-I{include}", f"-I{util}"], [cutlass_version.encode()]
    macros, flags = tuple(macros or ()), tuple(flags)
    key = _digest(source.read_bytes(), *headers, " ".join(macros + ARCH_FLAGS + flags).encode(), *version,
                  nvcc_version(nvcc).encode())

    def command(out: Path) -> List[str]:
        return [nvcc, *ARCH_FLAGS, *flags, *macros, *includes, "-o", str(out), str(source)]

    return cache_dir() / f"{name}-{key}.so", command


def build_cutlass_source(source: Path, name: str, macros, *, verbose: bool = False) -> Path:
    """Path of the cached .so of one instance (``macros``: its -D flags) of a CUTLASS source of
    this package, compiling it first if needed (the whole-or-absent, built-once cache: cache.py)."""
    return build_cached(*_entry(source, name, macros), name, verbose)


def open_cutlass_source(source: Path, name: str, macros, open_fn, *, verbose: bool = False):
    """``open_fn(path)`` of one instance's cached library; a library that fails to open is rebuilt
    once, then ``BuildError`` (cache.open_cached), which the backends turn into their fallback."""
    return open_cached(*_entry(source, name, macros), name, open_fn, verbose)


def build_plain_source(source: Path, *, verbose: bool = False) -> Path:
    """Path of the cached .so of a plain CUDA source (no CUTLASS headers), compiling it first if needed."""
    return build_cached(*_entry(source, source.stem), source.stem, verbose)


def open_plain_source(source: Path, open_fn, *, verbose: bool = False):
    """``open_fn(path)`` of a plain source's cached library; a library that fails to open is
    rebuilt once, then ``BuildError`` (cache.open_cached)."""
    return open_cached(*_entry(source, source.stem), source.stem, open_fn, verbose)


class GemmLibrary:
    """ctypes view of one grouped-GEMM instance's C ABI, the same in every source of this package:
    ``<prefix>_run`` (its ``run_argtypes``), ``<prefix>_workspace_bytes`` (cached per group count and
    SM count), ``<prefix>_last_error``. ``reported(lib)`` is what the library says it is; a library
    that reports other than ``expected`` is not the instance asked for (BuildError)."""

    def __init__(self, path: Path, prefix: str, run_argtypes, reported, expected):
        c = ctypes
        lib = ctypes.CDLL(str(path))
        self._workspace = getattr(lib, f"{prefix}_workspace_bytes")
        self._workspace.restype = c.c_int
        self._workspace.argtypes = [c.c_int, c.c_int, c.POINTER(c.c_size_t)]
        self._last_error = getattr(lib, f"{prefix}_last_error")
        self._last_error.restype = c.c_char_p
        got = reported(lib)
        if got != expected:
            raise BuildError(f"{path} is not the instance asked for: it reports {got}, expected {expected}")
        self.run = getattr(lib, f"{prefix}_run")
        self.run.restype = c.c_int
        self.run.argtypes = run_argtypes
        self._ws_cache = {}
        self.path = path

    def workspace_bytes(self, num_groups: int, sm_count: int) -> int:
        key = (num_groups, sm_count)
        got = self._ws_cache.get(key)
        if got is None:
            out = ctypes.c_size_t(0)
            self._workspace(num_groups, sm_count, ctypes.byref(out))
            got = self._ws_cache[key] = int(out.value)
        return got

    def last_error(self) -> str:
        return self._last_error().decode(errors="replace")


class Libraries:
    """The opened libraries of one source by a plain key tuple (launches look them up on every call,
    and building the frozen instance first costs more than the lookup); ``open(key)`` opens one
    (building it first if needed). One build at a time per process; a key whose build failed raises
    its error again, so a broken instance is not rebuilt on every call."""

    def __init__(self, open_key):
        self._open, self._lock = open_key, threading.Lock()
        self.loaded: dict = {}
        self._failed: dict = {}

    def get(self, key):
        lib = self.loaded.get(key)
        if lib is None:
            with self._lock:
                lib = self.loaded.get(key)
                if lib is None:
                    if key in self._failed:
                        raise BuildError(self._failed[key])
                    try:
                        lib = self.loaded[key] = self._open(key)
                    except BuildError as exc:
                        self._failed[key] = str(exc)
                        raise
        return lib


# te_gg_run(a, b, d, offsets, num_groups, n, k, row_scale, bias, workspace, workspace_bytes, sm_count, device_id,
#           stream)
_RUN_ARGTYPES = ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3
                 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p])


def _open_instance(key) -> GemmLibrary:
    """The library of one instance; a library that fails to open is rebuilt once, then BuildError."""
    inst = Instance(*key)
    return open_cutlass_source(SOURCE, inst.name, inst.macros, lambda path: GemmLibrary(
        path, "te_gg", _RUN_ARGTYPES, lambda lib: (lib.te_gg_kind(), lib.te_gg_config(), bool(lib.te_gg_out_f32())),
        (KINDS[inst.direction], inst.config, inst.out_f32)))


_LIBRARIES = Libraries(_open_instance)


def load(direction: str, config: int, out_f32: bool = False) -> GemmLibrary:
    """The library of one instance, built on first use (``Libraries`` says how it is kept)."""
    return _LIBRARIES.get((direction, config, out_f32))


def is_built(direction: str, config: int, out_f32: bool = False) -> bool:
    """Whether an instance is loaded or whole in the disk cache, so using it costs no compile (the
    autotuner times only such tiles; compiling one takes minutes). False without nvcc or headers."""
    if (direction, config, out_f32) in _LIBRARIES.loaded:
        return True
    inst = Instance(direction, config, out_f32)
    try:
        target = _entry(SOURCE, inst.name, inst.macros)[0]
    except BuildError:
        return False
    return entry_is_whole(target)
