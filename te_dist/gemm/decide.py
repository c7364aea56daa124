"""The one place that decides which backend runs a grouped GEMM (pure functions: no launches, no env reads).

bf16 and other high-precision calls (``choose``; first row that holds wins):

| choice | when |
|---|---|
| forced | ``backend=`` given: used if it can run, else ValueError saying why |
| loop | CPU tensors (the float32 reference) |
| measured | a measured entry for the call's bucket on this device (:mod:`.measure`): its fastest allowed candidate, but ``torch`` wherever torch is within ``MARGIN`` of it |
| loop | the call fuses work torch lacks (bias, row scale, an output dtype other than the input's), the group sizes are on the host, not capturing, fwd or dgrad, at most ``LOOP_MAX_GROUPS`` groups of ``LOOP_MIN_ROWS_PER_GROUP`` rows on average, a contraction of ``LOOP_MIN_CONTRACTION`` or more: cuBLAS per expert, then the epilogue |
| cutlass | the call fuses work torch lacks and our SM90 kernels can run it (the fused epilogue) |
| torch | ``torch._grouped_mm`` can run it: torch's own kernel is the default, so the default is never slower than it |
| cutlass | our kernels can run it (a torch without ``_grouped_mm``) |
| loop | everything else (fp16/fp32, odd sizes); refused while capturing a CUDA graph |

Why torch by default: our tile table was fitted on one GPU's sweeps; on shapes and GPUs it never
saw it lost to torch's kernel. Our kernels run by default only where they do work torch cannot
fuse; elsewhere a measurement on this device has to show them ahead by the margin.

FP8 calls (``choose_quantized``): our block-scaled CUTLASS kernels where they can run; cuBLAS per expert
(``torch._scaled_mm``) where the group sizes are on the host and each expert's GEMM is large
(``LOOP_MIN_FLOP_PER_EXPERT``, ``LOOP_MIN_FLOP_PER_EXPERT_BLOCK``); the emulated reference (dequantize, then the bf16
GEMM) wherever the kernels cannot run. torch has no block-scaled grouped FP8 GEMM, so it is no candidate here. The
thresholds' measurements and why the margin is 5% (the run-to-run spread of two close tiles): docs/kernels.md.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import settings as _settings, support

__all__ = ["BACKENDS", "QUANTIZED_BACKENDS", "MARGIN", "LOOP_MAX_GROUPS", "LOOP_MIN_ROWS_PER_GROUP",
           "LOOP_MIN_CONTRACTION", "LOOP_MIN_FLOP_PER_EXPERT", "LOOP_MIN_FLOP_PER_EXPERT_BLOCK", "Choice", "Problem",
           "capture_underway", "why_not", "static_choice", "pick_measured", "choose", "candidates", "quantized_why_not",
           "fp8_loop_why_not", "fp8_loop_wins", "choose_quantized"]

BACKENDS = ("cutlass", "torch", "loop")
QUANTIZED_BACKENDS = ("cutlass", "loop", "emulated")
MARGIN = 0.05  # a measured choice other than torch runs only where it beats torch by this fraction
LOOP_MAX_GROUPS, LOOP_MIN_ROWS_PER_GROUP, LOOP_MIN_CONTRACTION = 8, 512, 8192
LOOP_MAX_SHAPES = 8  # the loop is measured only where its first call plans at most this many GEMM shapes
LOOP_MIN_FLOP_PER_EXPERT, LOOP_MIN_FLOP_PER_EXPERT_BLOCK = 50e9, 100e9
Choice = Tuple[str, Optional[int]]  # (backend, CUTLASS tile config or None)
TORCH: Choice = ("torch", None)
_QUANTIZED_OUT = (torch.bfloat16, torch.float32)


class Problem(NamedTuple):
    """What the rule needs to know about one call (direction "fwd" | "dgrad" | "wgrad"; ``k`` the
    contraction for fwd and dgrad, in-features for wgrad). A NamedTuple: built where no remembered choice
    answers the call (``entry._runner``)."""

    direction: str
    device_type: str
    capability: Optional[Tuple[int, int]]
    dtype: torch.dtype
    out_dtype: torch.dtype
    num_rows: int
    k: int
    n: int
    num_groups: int
    weight_k_major: bool = True
    capturing: bool = False  # a CUDA graph is being captured (asked only where it matters: capture_underway)
    sizes_on_host: bool = False  # the caller passed the rows of each group as host ints
    epilogue: bool = False  # a bias or row scale to apply (with an output dtype other than the input's:
    # work torch._grouped_mm does not fuse)


def capture_underway() -> bool:
    """Whether the current CUDA stream is capturing a graph. Asking is a CUDA call of its own, and only
    the per-expert loop and a measurement care, so the call path decides as if not and asks where the
    choice is the loop (deciding again with ``capturing=True`` if so) or before a measurement."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def why_not(backend: str, p: Problem, *, cutlass_built: Callable[[], bool], torch_grouped: bool) -> Optional[str]:
    """None if ``backend`` can run ``p``, else why not (errors and docs). ``cutlass_built`` is asked last."""
    if backend == "loop":
        if p.capturing:
            return "the per-expert loop reads offsets on the host and cannot run inside CUDA graph capture"
        return None
    if backend == "torch" and p.device_type == "cpu":  # torch's CPU grouped_mm: allowed when forced
        return None if torch_grouped else "this torch has no torch._grouped_mm"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, received {backend!r}")
    if p.device_type != "cuda":
        return f"{backend} needs CUDA tensors, received device type {p.device_type!r}"
    if p.dtype != torch.bfloat16:
        return f"{backend} supports bfloat16 inputs only, received {p.dtype}"
    if p.k % 8 or p.n % 8:
        return f"{backend} needs K and N to be multiples of 8 (16-byte rows), received K={p.k} N={p.n}"
    if backend == "torch":
        if not torch_grouped:
            return "this torch has no torch._grouped_mm"
        if p.capability is None or p.capability < (9, 0):
            return f"torch._grouped_mm bf16 needs compute capability >= 9.0, received {p.capability}"
        return None
    if p.capability != (9, 0):
        return f"cutlass_kernels are built for sm_90a only, received compute capability {p.capability}"
    if p.out_dtype not in (torch.bfloat16, torch.float32):
        return f"cutlass_kernels write bfloat16 or float32, received out_dtype={p.out_dtype}"
    if p.direction != "wgrad" and not p.weight_k_major:
        return "cutlass_kernels need w_EKN to be a transposed view of a contiguous [E, N, K] weight"
    if not cutlass_built():
        return "cutlass_kernels are not available (no nvcc / CUTLASS headers, disabled, or the build failed)"
    return None


def _cublas_per_expert_wins(p: Problem) -> bool:
    """Few large groups, a long contraction, sizes on the host: cuBLAS per expert."""
    return (p.sizes_on_host and not p.capturing and p.direction != "wgrad" and 0 < p.num_groups <= LOOP_MAX_GROUPS
            and p.num_rows >= LOOP_MIN_ROWS_PER_GROUP * p.num_groups and p.k >= LOOP_MIN_CONTRACTION)


def static_choice(p: Problem, *, cutlass_built: Callable[[], bool], torch_grouped: bool) -> str:
    """The rule's answer without a measurement (rows 2 and 4-8 of the table)."""
    if p.device_type != "cuda":
        return "loop"
    fused = p.epilogue or p.out_dtype != p.dtype
    if fused:
        if _cublas_per_expert_wins(p):
            return "loop"
        if why_not("cutlass", p, cutlass_built=cutlass_built, torch_grouped=torch_grouped) is None:
            return "cutlass"
    if why_not("torch", p, cutlass_built=cutlass_built, torch_grouped=torch_grouped) is None:
        return "torch"
    if not fused and why_not("cutlass", p, cutlass_built=cutlass_built, torch_grouped=torch_grouped) is None:
        return "cutlass"
    reason = why_not("loop", p, cutlass_built=cutlass_built, torch_grouped=torch_grouped)
    if reason is not None:
        raise ValueError(f"no grouped-GEMM backend can run this {p.direction} call: {reason}")
    return "loop"


def pick_measured(ms: Dict[Choice, float], p: Problem) -> Optional[Choice]:
    """The fastest measured choice this call may run (the loop only with host sizes and not while
    capturing), but torch wherever torch is within MARGIN of it; None where nothing measured may run."""
    loop_ok = p.sizes_on_host and not p.capturing
    best, best_ms = None, float("inf")
    for choice, t in ms.items():
        if t < best_ms and (loop_ok or choice[0] != "loop"):
            best, best_ms = choice, t
    torch_ms = ms.get(TORCH)
    if best is not None and torch_ms is not None and best_ms * (1.0 + MARGIN) > torch_ms:
        return TORCH
    return best


def choose(p: Problem, *, cutlass_built: Callable[[], bool], torch_grouped: bool, forced: Optional[str] = None,
           measured: Optional[Dict[Choice, float]] = None) -> Choice:
    """(backend, tile config or None: the static tile table's) for one call; see the module table."""
    if forced is not None:
        reason = why_not(forced, p, cutlass_built=cutlass_built, torch_grouped=torch_grouped)
        if reason is not None:
            raise ValueError(f"backend={forced!r} cannot run this {p.direction} call: {reason}")
        return forced, None
    if measured:
        got = pick_measured(measured, p)
        if got is not None and got[0] == "cutlass" and not cutlass_built():  # disabled since it was measured
            got = pick_measured({c: t for c, t in measured.items() if c[0] != "cutlass"}, p)
        if got is not None:
            return got
    return static_choice(p, cutlass_built=cutlass_built, torch_grouped=torch_grouped), None


def candidates(p: Problem, *, cutlass_built: Callable[[], bool], torch_grouped: bool, configs: Sequence[int] = (),
               group_sizes=None) -> list:
    """What a measurement times, in order: torch, the given built tiles, the loop (host sizes, not
    capturing, at most ``LOOP_MAX_SHAPES`` distinct sizes: its first call plans one GEMM per size)."""
    out = []
    if why_not("torch", p, cutlass_built=cutlass_built, torch_grouped=torch_grouped) is None:
        out.append(TORCH)
    if configs and why_not("cutlass", p, cutlass_built=cutlass_built, torch_grouped=torch_grouped) is None:
        out += [("cutlass", c) for c in configs]
    if group_sizes is not None and not p.capturing and len(set(group_sizes)) <= LOOP_MAX_SHAPES:
        out.append(("loop", None))
    return out



def quantized_why_not(device, k: int, n: int, out_dtype, b_format: str, block_scales: bool = True) -> Optional[str]:
    """None when our FP8 kernels can run a call with these properties, else why not (the device part is the
    support predicates' own answer: ``support.fp8_kernels_why_not``). K and N: multiples of the 128 scale
    block, of 16 for tensor scales under ``settings.fp8_unpadded_tensor_scales`` (16-byte FP8 rows)."""
    if (reason := support.fp8_kernels_why_not(device)) is not None:
        return reason
    if k % (grid := 128 if block_scales or not _settings.current().fp8_unpadded_tensor_scales else 16) or n % grid:
        return f"the FP8 grouped kernels need K and N multiples of {grid}, received K={k} N={n}"
    if out_dtype not in _QUANTIZED_OUT:
        return f"the FP8 grouped kernels write {_QUANTIZED_OUT}, received out_dtype={out_dtype}"
    if b_format != "e4m3":
        return f"the FP8 grouped kernels take an e4m3 weight-side operand, received {b_format}"
    return None


def fp8_loop_why_not(*, device: torch.device, group_sizes: Optional[Sequence[int]], out_dtype: torch.dtype,
                     block_scales: bool, formats: Sequence[str], epilogue: bool, wgrad: bool,
                     contraction: int) -> Optional[str]:
    """None if cuBLAS per expert can run an FP8 call the grouped kernels could run, else why not.
    Block scales: cuBLAS reads 128x128 weight scales in rows padded to 4 blocks, so a fwd or dgrad
    contraction off a multiple of 512 stays on the grouped kernels."""
    if group_sizes is None:
        return "the per-expert loop needs the group sizes on the host (group_sizes=)"
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "the per-expert loop's launches follow host sizes, so it is not captured in a CUDA graph"
    if out_dtype != torch.bfloat16:
        return f"the per-expert loop writes bfloat16, received out_dtype={out_dtype}"
    if epilogue:
        return "a bias or row scale, or a wgrad's add into the gradient, is fused by the grouped kernels only"
    if block_scales and any(f != "e4m3" for f in formats):
        return f"cuBLAS block scaling takes e4m3 operands, received {tuple(formats)}"
    if block_scales and not wgrad and contraction % 512:
        return f"cuBLAS 128x128 weight scales need a contraction that is a multiple of 512, received {contraction}"
    if wgrad and (sum(group_sizes) % 16 or any(rows % 16 for rows in group_sizes)):
        return "the per-expert wgrad reads each expert's tokens at 16-byte boundaries: rows multiples of 16"
    return None


def fp8_loop_wins(num_rows: int, k: int, n: int, num_groups: int, block_scales: bool) -> bool:
    """Each expert's GEMM long enough, on average, that cuBLAS per expert beats one grouped launch."""
    per_expert = LOOP_MIN_FLOP_PER_EXPERT_BLOCK if block_scales else LOOP_MIN_FLOP_PER_EXPERT
    return num_groups > 0 and 2.0 * num_rows * k * n >= per_expert * num_groups


def choose_quantized(device, k: int, n: int, *, out_dtype=torch.bfloat16, b_format: str = "e4m3",
                     backend: Optional[str] = None, group_sizes=None, num_rows: int = 0, num_groups: int = 0,
                     block_scales: bool = False, a_format: str = "e4m3", epilogue: bool = False,
                     wgrad: bool = False, contraction: Optional[int] = None) -> str:
    """"cutlass", "loop" (cuBLAS per expert) or "emulated" for one FP8 call; a forced backend that cannot run raises
    ValueError saying why. ``contraction``: default ``k`` (fwd; dgrad contracts ``n``, wgrad the rows)."""
    if backend is not None and backend not in QUANTIZED_BACKENDS:
        raise ValueError(f"backend must be None or one of {QUANTIZED_BACKENDS}, received {backend!r}")
    if backend == "emulated":
        return backend
    device = torch.device(device)
    reason = quantized_why_not(device, k, n, out_dtype, b_format, block_scales)
    if reason is not None:
        if backend is not None:
            raise ValueError(f"backend={backend!r} cannot run this FP8 grouped GEMM: {reason}")
        return "emulated"
    if backend == "cutlass" or (backend is None and not fp8_loop_wins(num_rows, k, n, num_groups, block_scales)):
        return "cutlass"
    if group_sizes is not None:  # checked only where the loop may run: elsewhere they only hint
        from .validation import check_group_sizes

        group_sizes = check_group_sizes(group_sizes, num_groups, num_rows)
    loop_reason = fp8_loop_why_not(device=device, group_sizes=group_sizes, out_dtype=out_dtype,
                                   block_scales=block_scales, formats=(a_format, b_format), epilogue=epilogue,
                                   wgrad=wgrad, contraction=k if contraction is None else contraction)
    if loop_reason is None:
        return "loop"
    if backend == "loop":
        raise ValueError(f"backend='loop' cannot run this FP8 grouped GEMM: {loop_reason}")
    return "cutlass"
