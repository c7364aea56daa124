"""FP8 grouped GEMM instances (``fp8_block_gemm.cu``): tiles, JIT build, ctypes loader.

One instance per (direction, tile config, A format, B format, output dtype, scaling). Formats: "e4m3" or "e5m2"
(HYBRID gradients). Scaling: block scales (Float8BlockScaling) or one scale per operand (``tensor_scales``:
DelayedScaling, Float8CurrentScaling), which the epilogue applies, so per-tensor operands need no scale tables and the
mainloop no per-block multiply. The build and disk cache are the bf16 kernels' (``build.py``).

Tiles and their rule: ``heuristics.py``. A caller may force one tile for every call (``choose_fp8_config(...,
forced=id)``: te_dist passes its ``te_dist.settings.fp8_tile``, for tile sweeps).
"""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path
from typing import Optional, Sequence

from .build import KINDS, SCHEDULES, GemmLibrary, Libraries, build_cutlass_source, open_cutlass_source
from .heuristics import FP8_CONFIGS, FP8_FAST_LONG_K, FP8_FAST_SHORT_K, FP8_TENSOR_CONFIG, config_fits, fp8_config

__all__ = ["FP8_CONFIGS", "FORMATS", "Fp8Instance", "choose_fp8_config", "config_fits", "load_fp8",
           "build_fp8_instance"]

SOURCE = Path(__file__).resolve().parent / "fp8_block_gemm.cu"
FORMATS = ("e4m3", "e5m2")


def choose_fp8_config(direction: str, num_rows: int, num_groups: int, group_sizes: Optional[Sequence[int]] = None,
                      *, forced: Optional[int] = None, **rule) -> int:
    """The tile of one call: ``forced`` where given, else the rule (heuristics.fp8_config, ``rule`` its keywords)."""
    return forced if forced is not None else fp8_config(direction, num_rows, num_groups, **rule)


@dataclasses.dataclass(frozen=True)
class Fp8Instance:
    direction: str
    config: int = 0
    a_format: str = "e4m3"
    b_format: str = "e4m3"
    out_f32: bool = False
    tensor_scales: bool = False
    accumulate: bool = False  # wgrad adding into its output (TE_FB_ACCUMULATE)

    def __post_init__(self):
        if self.direction not in KINDS:
            raise ValueError(f"direction must be one of {tuple(KINDS)}, received {self.direction!r}")
        if self.config not in FP8_CONFIGS:
            raise ValueError(f"config must be one of {sorted(FP8_CONFIGS)}, received {self.config!r}")
        for name in ("a_format", "b_format"):
            if getattr(self, name) not in FORMATS:
                raise ValueError(f"{name} must be one of {FORMATS}, received {getattr(self, name)!r}")
        if not config_fits(self.direction, self.config, self.tensor_scales):
            raise ValueError(f"config {self.config} {FP8_CONFIGS[self.config][:3]} does not fit {self.direction} with "
                             f"{'tensor' if self.tensor_scales else 'block'} scales (heuristics.config_fits)")

    @property
    def name(self) -> str:
        out = "f32" if self.out_f32 else "bf16"
        scaling = "_tensor" if self.tensor_scales else ""
        acc = "_acc" if self.accumulate else ""  # (wgrad only: the source's static_assert)
        return f"te_fb_{self.direction}_c{self.config}_{self.a_format}x{self.b_format}_{out}{scaling}{acc}"

    @property
    def macros(self):
        schedule, tile_m, tile_n, (cluster_m, cluster_n), *epilogue_n = FP8_CONFIGS[self.config]
        return (f"-DTE_FB_KIND={KINDS[self.direction]}", f"-DTE_FB_CONFIG={self.config}",
                f"-DTE_FB_A_E5M2={int(self.a_format == 'e5m2')}", f"-DTE_FB_B_E5M2={int(self.b_format == 'e5m2')}",
                f"-DTE_FB_OUT_F32={int(self.out_f32)}", f"-DTE_FB_TENSOR_SCALES={int(self.tensor_scales)}",
                f"-DTE_FB_SCHEDULE={SCHEDULES[schedule]}",
                f"-DTE_FB_TILE_M={tile_m}", f"-DTE_FB_TILE_N={tile_n}",
                f"-DTE_FB_CLUSTER_M={cluster_m}", f"-DTE_FB_CLUSTER_N={cluster_n}", f"-DTE_FB_EPI_N={sum(epilogue_n)}",
                f"-DTE_FB_ACCUMULATE={int(self.accumulate)}")


def build_fp8_instance(inst: Fp8Instance, *, verbose: bool = False) -> Path:
    return build_cutlass_source(SOURCE, inst.name, inst.macros, verbose=verbose)


# te_fb_run(a, b, d, a_scale, b_scale, a_scale_scratch, offsets, num_groups, n, k, num_rows, row_scale, bias,
#           workspace, workspace_bytes, sm_count, device_id, stream)
_RUN_ARGTYPES = ([ctypes.c_void_p] * 7 + [ctypes.c_int] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 3
                 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p])


def _reported(lib) -> tuple:
    formats = lib.te_fb_formats()
    return (lib.te_fb_kind(), lib.te_fb_config(), *((formats >> bit) & 1 for bit in range(5)))


def _open_instance(key) -> GemmLibrary:
    """The library of one instance; a library that fails to open is rebuilt once, then BuildError."""
    inst = Fp8Instance(*key)
    expected = (KINDS[inst.direction], inst.config, int(inst.a_format == "e5m2"), int(inst.b_format == "e5m2"),
                int(inst.out_f32), int(inst.tensor_scales), int(inst.accumulate))
    return open_cutlass_source(SOURCE, inst.name, inst.macros,
                               lambda path: GemmLibrary(path, "te_fb", _RUN_ARGTYPES, _reported, expected))


_LIBRARIES = Libraries(_open_instance)


def load_fp8(direction: str, config: int, a_format: str, b_format: str, out_f32: bool = False,
             tensor_scales: bool = False, accumulate: bool = False) -> GemmLibrary:
    """The library of one instance, built on first use (``build.Libraries`` says how it is kept)."""
    return _LIBRARIES.get((direction, config, a_format, b_format, out_f32, tensor_scales, accumulate))


def fp8_candidate_instances():
    """Every config that fits each direction, in every format and scaling the recipes use: what a sweep may build."""
    return [Fp8Instance(d, c, a_format, tensor_scales=t) for t in (False, True) for d in KINDS
            for c in sorted(FP8_CONFIGS) if config_fits(d, c, t)
            for a_format in (("e4m3",) if d == "fwd" else FORMATS)]


def all_fp8_instances():
    """The instances the three recipes' formats need, block and tensor scales: E4M3 everywhere, and HYBRID's e5m2
    gradients (dgrad's A = dy, wgrad's A = dy^T); bf16 output (accumulating wgrads: float32 too); their own tiles."""
    return [Fp8Instance(d, c, a_format, tensor_scales=t) for t in (False, True) for d in KINDS for c in ((0, 1) if
            d != "wgrad" else (fp8_config(d, 1, 1),)) for a_format in (("e4m3",) if d == "fwd" else FORMATS)] + [
        Fp8Instance("fwd", c, tensor_scales=True) for c in (FP8_TENSOR_CONFIG, FP8_FAST_LONG_K, FP8_FAST_SHORT_K)] + [
        Fp8Instance("dgrad", FP8_TENSOR_CONFIG, a_format, tensor_scales=True) for a_format in FORMATS] + [
        Fp8Instance("wgrad", fp8_config("wgrad", 1, 1), a_format, out_f32=o, tensor_scales=t, accumulate=True) for t in
        (False, True) for a_format in FORMATS for o in (False, True)]  # fp8_wgrad_accumulation; float32: main_grad
