"""Grouped GEMM for expert MLPs: the one entry point, whatever runs underneath.

``grouped_mm(x_TK, w_EKN, offsets_E, *, bias_EN=None, row_scale_T=None, out_dtype=None)`` computes,
for the rows of expert e (rows ``offsets[e-1]:offsets[e]``, offsets = int32 cumulative END rows on
x's device, as ``torch._grouped_mm`` takes them)::

    y[rows] = row_scale[rows, None] * (x[rows] @ w[e]) + bias[e]

and is differentiable w.r.t. x, w, bias and row_scale. ``w_EKN`` is normally a transposed view of
a contiguous [E, N, K] weight ([E, out, in], like nn.Linear). Each call picks a backend
(``te_dist.backends.selection``): our CUTLASS SM90 kernels -> ``torch._grouped_mm`` -> a per-expert
loop (CPU, fp16/fp32, decode shapes). On CUDA a choice measured for the call's shape bucket
(``te_dist.backends.autotune``) overrides that static table. Inputs are validated before anything
launches.

Quantized (FP8) grouped GEMMs are entry points of the same stack:
``grouped_mm_quantized_forward / _dgrad / _wgrad`` take the operands as the recipe's quantizers
made them (``Float8Tensor`` or ``Float8BlockTensor`` activations, a weight prepared once per
version by ``prepare_quantized_weight``) and run on our block-scaled CUTLASS kernels; as cuBLAS per
expert where every expert's GEMM is large and the group sizes are on the host
(``te_dist.backends.fp8_selection``); or on the emulated reference (dequantize the same operands,
then the bf16 GEMM) wherever the kernels cannot run. All multiply the same quantized values; only
the accumulation differs.

Legend: T rows (tokens), K in-features, N out-features, E experts.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backends import autotune, fp8_selection, loop_backend, torch_backend, validation
from .backends.fp8_operands import BLOCK, QuantizedWeight, copy_format, dequantized, fp8_format, tensor_scales
from .backends.fp8_operands import prepare_weight as prepare_quantized_weight
from .backends.grouped_mm_function import GroupedMM
from .backends.selection import BACKENDS, Problem, choose_backend
from .support import device_capability

__all__ = [
    "grouped_mm",
    "grouped_mm_forward",
    "grouped_mm_dgrad",
    "grouped_mm_wgrad",
    "select_backend",
    "describe_choice",
    "available_backends",
    "BACKENDS",
    "QUANTIZED_BACKENDS",
    "QuantizedWeight",
    "prepare_quantized_weight",
    "grouped_mm_quantized_forward",
    "grouped_mm_quantized_dgrad",
    "grouped_mm_quantized_wgrad",
    "select_quantized_backend",
]


def _capability(device_index: int):
    return device_capability(torch.device("cuda", device_index))


_CUTLASS: dict = {}


def _cutlass_module():
    """Imported on first CUDA use, then held (an import statement per call cost ~1 us)."""
    module = _CUTLASS.get("module")
    if module is None:
        from .backends import cutlass_backend as module

        _CUTLASS["module"] = module
    return module


def _cutlass_built(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _cutlass_module().is_available(device)


def _problem(direction, a, k, n, num_groups, dtype, out_dtype, weight_k_major, group_sizes=None) -> Problem:
    device = a.device
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else None
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return Problem(direction, device.type, cap, dtype, out_dtype, a.shape[0], k, n, num_groups, weight_k_major, capturing,
                   group_sizes is not None)


def _weight_k_major(w_EKN: torch.Tensor) -> bool:
    E, K, N = w_EKN.shape
    return w_EKN.stride(1) == 1 and w_EKN.stride(2) == K and (E <= 1 or w_EKN.stride(0) == N * K)


def _select(p: Problem, device: torch.device, forced: Optional[str]) -> str:
    cutlass_ok = p.device_type == "cuda" and p.capability == (9, 0) and _cutlass_built(device)
    return choose_backend(p, cutlass_built=cutlass_ok, torch_grouped=torch_backend.is_available(), forced=forced)


def select_backend(direction: str, x_TK: torch.Tensor, w_EKN: torch.Tensor, *, out_dtype=None, backend=None,
                   group_sizes=None) -> str:
    """The backend a call with these operands would use (for benchmarks, logs and `te-dist env`).
    ``x_TK`` is the call's row operand (dgrad: dy); ``group_sizes`` as the entry points take it."""
    E, K, N = w_EKN.shape
    if direction == "dgrad":
        K, N = N, K  # dgrad contracts over N and writes K columns
    p = _problem(direction, x_TK, K, N, E, x_TK.dtype, out_dtype or x_TK.dtype, _weight_k_major(w_EKN), group_sizes)
    return _select(p, x_TK.device, backend)


def describe_choice(direction: str, x_TK: torch.Tensor, w_EKN: torch.Tensor, *, out_dtype=None,
                    group_sizes=None) -> str:
    """What a call with these operands would run, and why: ``"cutlass:2 measured"`` (the bucket's
    tuned choice; ``settling`` while its live calls still time candidates), ``"torch static"`` (the
    static table). Measures nothing (benchmarks, the tune CLI)."""
    E, K, N = w_EKN.shape
    if group_sizes is not None:
        group_sizes = tuple(group_sizes)
    if direction == "dgrad":
        p = _problem(direction, x_TK, N, K, E, x_TK.dtype, out_dtype or x_TK.dtype, _weight_k_major(w_EKN), group_sizes)
    else:
        p = _problem(direction, x_TK, K, N, E, x_TK.dtype, out_dtype or x_TK.dtype,
                     direction == "wgrad" or _weight_k_major(w_EKN), group_sizes)
    name = _select(p, x_TK.device, None)
    tuner = autotune.tuner()
    if p.device_type == "cuda" and tuner.enabled:
        index = x_TK.device.index if x_TK.device.index is not None else torch.cuda.current_device()
        table, key = tuner.table_for(index), autotune.bucket_key(p, group_sizes)
        ranking = table.ranking.get(key)
        if ranking is not None and not (tuner.deterministic() and not tuner.agreed):
            choice = tuner.choose_from(ranking, p)
            if choice is not None:
                return f"{autotune.choice_name(choice)} {'settling' if key in table.settling else 'measured'}"
    if name == "cutlass":
        config = _static_config(direction, x_TK.device, x_TK.shape[0], N, K, E,
                                None if direction == "wgrad" else group_sizes)
        return f"cutlass:{config} static"
    return f"{name} static"


def available_backends(device) -> list:
    """Backends that can run a bf16 call on ``device`` (ignoring shape constraints)."""
    device = torch.device(device)
    out = []
    if device.type == "cuda":
        cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
        if cap == (9, 0) and _cutlass_built(device):
            out.append("cutlass")
        if cap >= (9, 0) and torch_backend.is_available():
            out.append("torch")
    out.append("loop")
    return out


def _static_config(direction, device, num_rows, n, k, num_groups, group_sizes) -> Optional[int]:
    """The tile the static table picks (cutlass_kernels/heuristics.py); n/k: user-level out/in features."""
    ck = _cutlass_module().kernels_module()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return ck.choose_config(direction, num_rows, n, k, num_groups, _cutlass_module()._sm_count(index), group_sizes)


def _tuned(p: Problem, device, group_sizes, name: str, run, static_config) -> tuple:
    """(backend, tile config or None): the measured choice of the call's bucket, else the static one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    got = autotune.choose(p, index, group_sizes, lambda: _miss_context(p, device, name, run, static_config))
    return (name, None) if got is None else got


def _miss_context(p: Problem, device, name: str, run, static_config) -> autotune.MissContext:
    if torch_backend.is_available():  # its kernels loaded by a tiny call, not in a timed sample
        torch_backend.load(device)
    cutlass_ok = p.capability == (9, 0) and _cutlass_built(device)
    static = (name, static_config() if name == "cutlass" else None)
    if not cutlass_ok:
        return autotune.MissContext(static, run, False, torch_backend.is_available())
    ck = _cutlass_module().kernels_module()
    out_f32 = p.out_dtype == torch.float32
    return autotune.MissContext(static, run, True, torch_backend.is_available(), tuple(sorted(ck.CONFIGS)),
                                lambda c: _built_and_open(ck, p.direction, c, out_f32))


def _built_and_open(ck, direction: str, config: int, out_f32: bool) -> bool:
    """A tile the tuner may time: built, and its library opened now, so opening it is not counted
    in its first timed call (milliseconds of host work, against calls of 0.05-5 ms)."""
    if not ck.build.is_built(direction, config, out_f32):
        return False
    try:
        ck.load(direction, config, out_f32)
    except Exception:  # noqa: BLE001 - a library that does not open cannot be a candidate
        return False
    return True


def _forward_with(choice, x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes):
    name, config = choice
    if name == "loop":
        return loop_backend.forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes)
    if name == "cutlass":  # the host sizes also pick its tile (cutlass_kernels/heuristics.py)
        return _cutlass_module().forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, config=config,
                                         group_sizes=group_sizes)
    return torch_backend.forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype)


def _dgrad_with(choice, dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, group_sizes):
    name, config = choice
    if name == "loop":
        return loop_backend.dgrad(dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, group_sizes)
    if name == "cutlass":
        return _cutlass_module().dgrad(dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, config=config,
                                       group_sizes=group_sizes)
    return torch_backend.dgrad(dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype)


def _wgrad_with(choice, x_TK, dy_TN, offsets_E, num_groups, out_dtype, group_sizes):
    name, config = choice
    if name == "loop":
        return loop_backend.wgrad(x_TK, dy_TN, offsets_E, num_groups, out_dtype, group_sizes)
    if name == "cutlass":  # no size-dependent static tile for wgrad: it pads no rows
        return _cutlass_module().wgrad(x_TK, dy_TN, offsets_E, num_groups, out_dtype, config=config)
    return torch_backend.wgrad(x_TK, dy_TN, offsets_E, num_groups, out_dtype)


class _Dispatch:
    """Validated-input entry points used by the autograd function (one object, no state)."""

    @staticmethod
    def forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, backend, group_sizes=None):
        out_dtype = out_dtype or x_TK.dtype
        if backend is None and x_TK.is_cpu:
            # The selection table's CPU row ("loop"), without building a Problem on the hot path.
            return loop_backend.forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes)
        E, K, N = w_EKN.shape
        p = _problem("fwd", x_TK, K, N, E, x_TK.dtype, out_dtype, _weight_k_major(w_EKN), group_sizes)
        choice = (_select(p, x_TK.device, backend), None)
        if backend is None and p.device_type == "cuda":
            args = (x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes)
            choice = _tuned(p, x_TK.device, group_sizes, choice[0], lambda c: lambda: _forward_with(c, *args),
                            lambda: _static_config("fwd", x_TK.device, x_TK.shape[0], N, K, E, group_sizes))
            if choice.__class__ is autotune.Settling:  # the bucket's undecided candidates take turns
                return choice.call(lambda c: _forward_with(c, *args))
        return _forward_with(choice, x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes)

    @staticmethod
    def dgrad(dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, backend, group_sizes=None):
        out_dtype = out_dtype or dy_TN.dtype
        if backend is None and dy_TN.is_cpu:
            return loop_backend.dgrad(dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, group_sizes)
        E, K, N = w_EKN.shape
        # dgrad contracts over N and writes K columns.
        p = _problem("dgrad", dy_TN, N, K, E, dy_TN.dtype, out_dtype, _weight_k_major(w_EKN), group_sizes)
        choice = (_select(p, dy_TN.device, backend), None)
        if backend is None and p.device_type == "cuda":
            args = (dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, group_sizes)
            choice = _tuned(p, dy_TN.device, group_sizes, choice[0], lambda c: lambda: _dgrad_with(c, *args),
                            lambda: _static_config("dgrad", dy_TN.device, dy_TN.shape[0], N, K, E, group_sizes))
            if choice.__class__ is autotune.Settling:  # the bucket's undecided candidates take turns
                return choice.call(lambda c: _dgrad_with(c, *args))
        return _dgrad_with(choice, dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, group_sizes)

    @staticmethod
    def wgrad(x_TK, dy_TN, offsets_E, num_groups, out_dtype, backend, group_sizes=None):
        out_dtype = out_dtype or x_TK.dtype
        if backend is None and x_TK.is_cpu:
            return loop_backend.wgrad(x_TK, dy_TN, offsets_E, num_groups, out_dtype, group_sizes)
        K, N = x_TK.shape[1], dy_TN.shape[1]
        p = _problem("wgrad", x_TK, K, N, num_groups, x_TK.dtype, out_dtype, True, group_sizes)
        choice = (_select(p, x_TK.device, backend), None)
        if backend is None and p.device_type == "cuda":
            args = (x_TK, dy_TN, offsets_E, num_groups, out_dtype, group_sizes)
            choice = _tuned(p, x_TK.device, group_sizes, choice[0], lambda c: lambda: _wgrad_with(c, *args),
                            lambda: _static_config("wgrad", x_TK.device, x_TK.shape[0], N, K, num_groups, None))
            if choice.__class__ is autotune.Settling:  # the bucket's undecided candidates take turns
                return choice.call(lambda c: _wgrad_with(c, *args))
        return _wgrad_with(choice, x_TK, dy_TN, offsets_E, num_groups, out_dtype, group_sizes)


def _check_backend_arg(backend) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, received {backend!r}")


def grouped_mm(
    x_TK: torch.Tensor,
    w_EKN: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    bias_EN: Optional[torch.Tensor] = None,
    row_scale_T: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
    check_offsets: Optional[bool] = None,
    group_sizes=None,
) -> torch.Tensor:
    """Differentiable grouped GEMM with a fused per-row scale and per-expert bias (see module doc).

    ``check_offsets``: read offsets' values on the host to validate them (default: only for CPU
    offsets; on CUDA this would sync and break graph capture).
    ``group_sizes``: the rows of each expert as host ints (list, tuple or CPU tensor), when the
    caller has them anyway (an MoE layer does, from its count exchange). They let the selector
    see the actual group sizes and the per-expert loop skip reading the offsets; they must agree
    with the offsets (checked against the row count, not read from the device).
    """
    _check_backend_arg(backend)
    validation.check_forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, check_offsets)
    if group_sizes is not None:
        group_sizes = validation.check_group_sizes(group_sizes, w_EKN.shape[0], x_TK.shape[0])
    return GroupedMM.apply(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, backend, _Dispatch, group_sizes)


def grouped_mm_forward(x_TK, w_EKN, offsets_E, *, bias_EN=None, row_scale_T=None, out_dtype=None,
                       backend=None, check_offsets=None, group_sizes=None) -> torch.Tensor:
    """Forward only (no autograd graph): y = row_scale * (x @ w[e]) + bias[e]. ``group_sizes``: as
    for grouped_mm."""
    _check_backend_arg(backend)
    validation.check_forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, check_offsets)
    if group_sizes is not None:
        group_sizes = validation.check_group_sizes(group_sizes, w_EKN.shape[0], x_TK.shape[0])
    return _Dispatch.forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, backend, group_sizes)


def grouped_mm_dgrad(dy_TN, w_EKN, offsets_E, *, row_scale_T=None, out_dtype=None, backend=None,
                     check_offsets=None, group_sizes=None, validate: bool = True) -> torch.Tensor:
    """dx = row_scale * (dy @ w[e]^T) for the rows of each expert. ``group_sizes``: as for grouped_mm.

    ``validate=False`` skips the input checks: only for a backward pass whose operands its forward
    already validated (the forward's own weight and offsets; autograd fixes dy's shape and dtype)."""
    _check_backend_arg(backend)
    if validate:
        validation.check_dgrad(dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, check_offsets)
        if group_sizes is not None:
            group_sizes = validation.check_group_sizes(group_sizes, w_EKN.shape[0], dy_TN.shape[0])
    return _Dispatch.dgrad(dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, backend, group_sizes)


def grouped_mm_wgrad(x_TK, dy_TN, offsets_E, *, num_groups: Optional[int] = None, out_dtype=None, backend=None,
                     check_offsets=None, group_sizes=None, validate: bool = True) -> torch.Tensor:
    """dw[e] = x_e^T @ dy_e as [E, K, N], a transposed view of a contiguous [E, N, K] buffer
    (the weight's storage layout). Experts without rows get zeros. ``group_sizes``, ``validate``:
    as for dgrad."""
    _check_backend_arg(backend)
    if num_groups is None:
        num_groups = offsets_E.numel() if isinstance(offsets_E, torch.Tensor) else -1
    if validate:
        validation.check_wgrad(x_TK, dy_TN, offsets_E, num_groups, out_dtype, check_offsets)
        if group_sizes is not None:
            group_sizes = validation.check_group_sizes(group_sizes, num_groups, x_TK.shape[0])
    return _Dispatch.wgrad(x_TK, dy_TN, offsets_E, num_groups, out_dtype, backend, group_sizes)


# --------------------------------------------------------------------------- quantized (FP8) grouped GEMMs

QUANTIZED_BACKENDS = ("cutlass", "loop", "emulated")
_QUANTIZED_OUT = (torch.bfloat16, torch.float32)


def _fp8_backend():
    module = _CUTLASS.get("fp8")
    if module is None:
        from .backends import fp8_cutlass_backend as module

        _CUTLASS["fp8"] = module
    return module


def _fp8_loop():
    from .backends import fp8_loop_backend

    return fp8_loop_backend


def _quantized_why_not(device: torch.device, k: int, n: int, out_dtype, b_format: str) -> Optional[str]:
    """None when the CUTLASS FP8 kernels can run a call with these properties, else why not."""
    if device.type != "cuda":
        return f"the FP8 grouped kernels need CUDA tensors, received {device.type}"
    cap = device_capability(device)
    if cap != (9, 0):
        return f"the FP8 grouped kernels are built for sm_90a, received compute capability {cap}"
    if k % BLOCK or n % BLOCK:
        return f"the FP8 grouped kernels need K and N multiples of {BLOCK}, received K={k} N={n}"
    if out_dtype not in _QUANTIZED_OUT:
        return f"the FP8 grouped kernels write {_QUANTIZED_OUT}, received out_dtype={out_dtype}"
    if b_format != "e4m3":
        return f"the FP8 grouped kernels take an e4m3 weight-side operand, received {b_format}"
    backend = _fp8_backend()
    if not backend.available():
        return f"the FP8 grouped kernels are unavailable: {backend.unavailable_reason()}"
    return None


def select_quantized_backend(device, k: int, n: int, *, out_dtype=torch.bfloat16, b_format: str = "e4m3",
                             backend: Optional[str] = None, group_sizes=None, num_rows: int = 0, num_groups: int = 0,
                             block_scales: bool = False, a_format: str = "e4m3", epilogue: bool = False,
                             wgrad: bool = False, contraction: Optional[int] = None) -> str:
    """"cutlass" where our FP8 kernels can run the call, "loop" where cuBLAS per expert beats them
    (backends/fp8_selection.py: the group sizes on the host and large experts), else "emulated";
    a forced backend that cannot run raises ValueError saying why. ``contraction``: the GEMM's
    contracted extent (default ``k``: fwd; dgrad contracts ``n``, wgrad the rows)."""
    if backend is not None and backend not in QUANTIZED_BACKENDS:
        raise ValueError(f"backend must be None or one of {QUANTIZED_BACKENDS}, received {backend!r}")
    if backend == "emulated":
        return backend
    device = torch.device(device)
    reason = _quantized_why_not(device, k, n, out_dtype, b_format)
    if reason is not None:
        if backend is not None:
            raise ValueError(f"backend={backend!r} cannot run this FP8 grouped GEMM: {reason}")
        return "emulated"
    if backend == "cutlass" or (backend is None and not fp8_selection.loop_wins(num_rows, k, n, num_groups, block_scales)):
        return "cutlass"
    if group_sizes is not None:  # checked only where the loop may run: the other paths only hint with them
        group_sizes = validation.check_group_sizes(group_sizes, num_groups, num_rows)
    loop_reason = fp8_selection.loop_why_not(
        device=device, group_sizes=group_sizes, out_dtype=out_dtype, block_scales=block_scales,
        formats=(a_format, b_format), epilogue=epilogue, wgrad=wgrad,
        contraction=k if contraction is None else contraction)
    if loop_reason is None:
        return "loop"
    if backend == "loop":
        raise ValueError(f"backend='loop' cannot run this FP8 grouped GEMM: {loop_reason}")
    return "cutlass"


def _check_quantized(name: str, q, ndim: int) -> None:
    from .quantization.tensors import QuantizedTensor

    if not isinstance(q, (QuantizedTensor, QuantizedWeight)):
        raise TypeError(f"{name} must be a quantized tensor (te_dist.quantization), received {type(q).__name__}")
    if len(q.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, received shape {tuple(q.shape)}")


def _check_quantized_offsets(offsets_E, num_groups: int, device) -> None:
    if not isinstance(offsets_E, torch.Tensor) or offsets_E.dtype != torch.int32 or offsets_E.shape != (num_groups,):
        got = f"{offsets_E.dtype} {tuple(offsets_E.shape)}" if isinstance(offsets_E, torch.Tensor) else type(offsets_E)
        raise TypeError(f"offsets_E must be an int32 tensor of shape [{num_groups}] (cumulative end rows), received {got}")
    if offsets_E.device != device:
        raise ValueError(f"offsets_E is on {offsets_E.device} but the operands are on {device}")


def _data_device(q):
    return q.fwd_data.device if isinstance(q, QuantizedWeight) else q.device


def _weight_format(wq) -> str:
    return fp8_format(wq.fwd_data)


def grouped_mm_quantized_forward(xq, wq: QuantizedWeight, offsets_E, *, bias_EN=None, row_scale_T=None,
                                 out_dtype=torch.bfloat16, backend=None, group_sizes=None) -> torch.Tensor:
    """y[T, N] = row_scale * (x @ w[e]^T) + bias[e] from quantized x [T, K] and a prepared weight [E, N, K]."""
    _check_quantized("xq", xq, 2)
    _check_quantized("wq", wq, 3)
    E, N, K = wq.shape
    if xq.shape[1] != K:
        raise ValueError(f"xq has {xq.shape[1]} features but the weight [E={E}, N={N}, K={K}] takes K={K}")
    device = _data_device(xq)
    _check_quantized_offsets(offsets_E, E, device)
    name = select_quantized_backend(
        device, K, N, out_dtype=out_dtype, b_format=_weight_format(wq), backend=backend, group_sizes=group_sizes,
        num_rows=xq.shape[0], num_groups=E, block_scales=not tensor_scales(xq, wq), a_format=copy_format(xq, "rowwise"),
        epilogue=bias_EN is not None or row_scale_T is not None, contraction=K)
    if name == "loop":
        return _fp8_loop().forward(xq, wq, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes)
    if name == "cutlass":
        fb = _fp8_backend()
        return fb.guarded(fb.forward, _emulated_forward)(xq, wq, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes)
    return _emulated_forward(xq, wq, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes)


def grouped_mm_quantized_dgrad(dyq, wq: QuantizedWeight, offsets_E, *, out_dtype=torch.bfloat16, backend=None,
                               group_sizes=None) -> torch.Tensor:
    """dx[T, K] = dy @ w[e] from quantized dy [T, N] and a prepared weight [E, N, K]."""
    _check_quantized("dyq", dyq, 2)
    _check_quantized("wq", wq, 3)
    E, N, K = wq.shape
    if dyq.shape[1] != N:
        raise ValueError(f"dyq has {dyq.shape[1]} features but the weight [E={E}, N={N}, K={K}] gives N={N}")
    device = _data_device(dyq)
    _check_quantized_offsets(offsets_E, E, device)
    name = select_quantized_backend(
        device, K, N, out_dtype=out_dtype, b_format=_weight_format(wq), backend=backend, group_sizes=group_sizes,
        num_rows=dyq.shape[0], num_groups=E, block_scales=not tensor_scales(dyq, wq),
        a_format=copy_format(dyq, "rowwise"), contraction=N)
    if name == "loop":
        return _fp8_loop().dgrad(dyq, wq, offsets_E, out_dtype, group_sizes)
    if name == "cutlass":
        fb = _fp8_backend()
        return fb.guarded(fb.dgrad, _emulated_dgrad)(dyq, wq, offsets_E, out_dtype, group_sizes)
    return _emulated_dgrad(dyq, wq, offsets_E, out_dtype, group_sizes)


def grouped_mm_quantized_wgrad(xq, dyq, offsets_E, *, num_groups: int, out_dtype=torch.bfloat16,
                               backend=None, group_sizes=None) -> torch.Tensor:
    """dw[e] = dy_e^T @ x_e as [E, N, K] from the columnwise copies of quantized x [T, K] and
    dy [T, N]. Every group's first row must be a multiple of the recipe's split alignment (128 for
    block scales, 16 for per-tensor): the caller guarantees it (the support predicates ask)."""
    _check_quantized("xq", xq, 2)
    _check_quantized("dyq", dyq, 2)
    if xq.shape[0] != dyq.shape[0]:
        raise ValueError(f"xq has {xq.shape[0]} rows but dyq has {dyq.shape[0]}")
    T, K = xq.shape
    N = dyq.shape[1]
    device = _data_device(xq)
    _check_quantized_offsets(offsets_E, num_groups, device)
    a_format = copy_format(dyq, "columnwise")
    b_format = copy_format(xq, "columnwise")
    name = select_quantized_backend(
        device, K, N, out_dtype=out_dtype, b_format=b_format, backend=backend, group_sizes=group_sizes, num_rows=T,
        num_groups=num_groups, block_scales=not tensor_scales(xq, dyq), a_format=a_format, wgrad=True, contraction=T)
    if name == "loop":
        return _fp8_loop().wgrad(xq, dyq, offsets_E, num_groups, out_dtype, group_sizes)
    if name == "cutlass":
        fb = _fp8_backend()
        return fb.guarded(fb.wgrad, _emulated_wgrad)(xq, dyq, offsets_E, num_groups, out_dtype)
    return _emulated_wgrad(xq, dyq, offsets_E, num_groups, out_dtype)


def _emulated_forward(xq, wq, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes):
    x = dequantized(xq, "rowwise", out_dtype)
    w = dequantized(wq, "rowwise", out_dtype)
    return grouped_mm_forward(x, w.transpose(1, 2), offsets_E, bias_EN=bias_EN, row_scale_T=row_scale_T,
                              out_dtype=out_dtype, check_offsets=False, group_sizes=group_sizes)


def _emulated_dgrad(dyq, wq, offsets_E, out_dtype, group_sizes):
    dy = dequantized(dyq, "rowwise", out_dtype)
    w = dequantized(wq, "columnwise", out_dtype)
    return grouped_mm_dgrad(dy, w.transpose(1, 2), offsets_E, out_dtype=out_dtype, group_sizes=group_sizes,
                            validate=False)


def _emulated_wgrad(xq, dyq, offsets_E, num_groups, out_dtype):
    x = dequantized(xq, "columnwise", out_dtype)
    dy = dequantized(dyq, "columnwise", out_dtype)
    dw_EKN = grouped_mm_wgrad(x, dy, offsets_E, num_groups=num_groups, out_dtype=out_dtype, validate=False)
    return dw_EKN.transpose(1, 2)
