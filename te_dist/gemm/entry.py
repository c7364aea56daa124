"""The bf16 (and fp16/fp32) grouped-GEMM entry points: validate, decide, run.

``grouped_mm(x_TK, w_EKN, offsets_E, *, bias_EN=None, row_scale_T=None, out_dtype=None)`` computes,
for the rows of expert e (rows ``offsets[e-1]:offsets[e]``, offsets = int32 cumulative END rows on
x's device, as ``torch._grouped_mm`` takes them)::

    y[rows] = row_scale[rows, None] * (x[rows] @ w[e]) + bias[e]

differentiable w.r.t. x, w, bias and row_scale. ``w_EKN`` is normally the transposed view of a contiguous [E, N, K]
weight ([E, out, in], like nn.Linear). Per call: the inputs are checked (:mod:`.validation`), the backend is chosen
(:mod:`.decide`; on CUDA with the bucket's measured entry from :mod:`.measure`) and run. The tuner remembers the
function to run under ``_runner``'s key and under the facts a public call was checked on (each operand's class,
dtype, device and shape but the rows; the options; the generations; the weight's strides only for a forced cutlass,
the one forced backend they decide), so a like call checks only its rows, where there is anything to check (CPU
offsets by default, host sizes). Legend: T rows (tokens), K in-features, N out-features, E experts.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import settings as _settings
from .. import support
from ..support import device_capability
from . import cutlass_backend, decide, loop_backend, measure, torch_backend, validation
from .autograd import GroupedMM

__all__ = ["grouped_mm", "grouped_mm_forward", "grouped_mm_dgrad", "grouped_mm_wgrad", "select_backend",
           "describe_choice", "available_backends"]

_TORCH_GROUPED = hasattr(torch, "_grouped_mm")  # torch's own grouped kernel (torch >= 2.8)
_HELD = measure._TUNER  # the process tuner's holder: a like call reads its memo without a call (none yet: a miss)


def _problem(direction, a, w_shape, w_strides, out_dtype, group_sizes, epilogue) -> decide.Problem:
    """The call as the rule sees it (``w_shape``, ``w_strides``: the weight's; wgrad: its output's
    [E, K, N] and None), decided as if no CUDA graph were being captured: asking costs a CUDA call,
    and only a loop choice or a measurement depends on it (``_choose`` asks then)."""
    (E, K, N), s = w_shape, w_strides  # k-major: the transposed view of a contiguous [E, N, K] weight (our kernels')
    k_major = s is None or (s[1] == 1 and s[2] == K and (E <= 1 or s[0] == N * K))
    if direction == "dgrad":
        K, N = N, K  # dgrad contracts over N and writes K columns
    cuda = a.is_cuda  # (a CUDA device's type is not read: a string built per call)
    return decide.Problem(direction, "cuda" if cuda else a.device.type, device_capability(a.device) if cuda else None,
                          a.dtype, out_dtype, a.shape[0], K, N, E, k_major, False, group_sizes is not None, epilogue)


def _choose(p: decide.Problem, device, forced, group_sizes, call) -> decide.Choice:
    """The decision, with the bucket's measured entry on CUDA (``call(choice)`` makes the call; None: the rule without
    a measurement). A loop choice on CUDA asks whether a graph is being captured, and if so the rule decides again."""
    cutlass_ok = lambda: p.capability == (9, 0) and cutlass_backend.is_available(device)  # noqa: E731
    measured, t = None, measure.tuner()
    if forced is None and call is not None and p.device_type == "cuda" and t.enabled:
        measured = t.entry(p, device.index, group_sizes, lambda: [(c, lambda c=c: call(c)) for c in decide.candidates(
            p, cutlass_built=cutlass_ok, torch_grouped=_TORCH_GROUPED, configs=_built_tiles(p), group_sizes=group_sizes)])
    choice = decide.choose(p, cutlass_built=cutlass_ok, torch_grouped=_TORCH_GROUPED, forced=forced, measured=measured)
    if choice[0] == "loop" and p.device_type == "cuda" and decide.capture_underway():
        choice = decide.choose(p._replace(capturing=True), cutlass_built=cutlass_ok, torch_grouped=_TORCH_GROUPED,
                               forced=forced, measured=measured)
    return choice


def _built_tiles(p: decide.Problem) -> tuple:
    """The bf16 tiles a measurement may time: built, and their library opened now (not on the clock)."""
    if p.capability != (9, 0) or not cutlass_backend.is_available(None):
        return ()
    ck = cutlass_backend.kernels_module()
    out = []
    for config in sorted(ck.CONFIGS):
        try:
            if ck.build.is_built(p.direction, config, p.out_dtype == torch.float32):
                ck.load(p.direction, config, p.out_dtype == torch.float32)
                out.append(config)
        except Exception:  # noqa: BLE001 - a library that does not open cannot be a candidate
            pass
    return tuple(out)


_FUNCTION = {"fwd": "forward", "dgrad": "dgrad", "wgrad": "wgrad"}  # each backend's function per direction


def _function(direction: str, choice):
    """The function that runs ``choice`` (a cutlass tile bound to it) as ``f(*args)``: every backend takes
    the direction's arguments through the output dtype and the host sizes alike."""
    backend = {"torch": torch_backend, "loop": loop_backend, "cutlass": cutlass_backend}[choice[0]]
    function = getattr(backend, _FUNCTION[direction])
    return functools.partial(function, config=choice[1]) if choice[0] == "cutlass" else function


def _runner(direction, args: tuple, a, device, dtype, w_shape, w_strides, epilogue, backend, facts=None):
    """The function that runs ``_choose``'s answer on ``args`` (the direction's arguments through the output dtype
    and the host sizes; ``a`` the row operand, on ``device`` of ``dtype``; ``w_shape``, ``w_strides``: the weight's,
    wgrad: its [E, K, N] and None), remembered by the process tuner under all that decides it: the call's facts
    (its rows as the bucket and the loop rule read them), the settings' and support's generations. Not kept where
    a later call may decide otherwise: a loop on CUDA (it asks about graph capture), an unmeasured bucket. A public
    call's checked ``facts`` keep it too where it is kept and the rows do not decide it (else the way to decide)."""
    group_sizes, t, rows = args[-1], measure.tuner(), None
    if backend is None and a.is_cpu:  # the rule's CPU row, without building a Problem
        return t.remember(facts, getattr(loop_backend, _FUNCTION[direction]))
    if backend is None:  # what the rule and a measurement read of the rows
        rows, sizes, E = a.shape[0], group_sizes, w_shape[0]
        rows = (measure.bucket_rows(rows, E), rows >= decide.LOOP_MIN_ROWS_PER_GROUP * E,
                bool(sizes) and sizes.count(sizes[0]) != len(sizes), t.deterministic())
    key = (direction, device, dtype, args[-2], w_shape, w_strides, epilogue, backend, group_sizes is None, rows,
           _settings.generation, support.generation)
    run = t.runners.get(key)
    if run is None:
        if backend is not None and backend not in decide.BACKENDS:
            raise ValueError(f"backend must be None or one of {decide.BACKENDS}, received {backend!r}")
        p = _problem(direction, a, w_shape, w_strides, args[-2] or dtype, group_sizes, epilogue)
        choice = _choose(p, device, backend, group_sizes, lambda c: _function(direction, c)(*args))
        run = _function(direction, choice)
        if p.device_type != "cuda" or (choice[0] != "loop" and (
                rows is None or not t.enabled or measure.bucket_key(p, group_sizes) in t.table_for(device.index).ms)):
            t.remember(key, run)
    if facts is not None:
        t.remember(facts, run if rows is None and t.runners.get(key) is run else (
            lambda *a, b=backend, seen=(device, dtype, w_shape): _dispatch(direction, a[:-1], b, a[-1], seen)))
    return run


def _dispatch(direction, args: tuple, backend, group_sizes=None, seen=None, facts=None):
    """Runs ``args`` (the direction's arguments through the output dtype) with ``_runner``'s function: autograd's
    path, and a public call's first (``seen``: what its checks read, else read here; ``facts``: what they passed)."""
    a, b, wgrad = args[0], args[1], direction == "wgrad"
    device, dtype, w_shape = seen or (a.device, a.dtype, (args[3], a.shape[1], b.shape[1]) if wgrad else b.shape)
    epilogue = not wgrad and (args[3] is not None or (direction == "fwd" and args[4] is not None))
    args += (group_sizes,)
    return _runner(direction, args, a, device, dtype, w_shape, None if wgrad else b.stride(), epilogue, backend,
                   facts)(*args)


def grouped_mm(x_TK, w_EKN, offsets_E, *, bias_EN=None, row_scale_T=None, out_dtype=None, backend=None,
               check_offsets: Optional[bool] = None, group_sizes=None) -> torch.Tensor:
    """Differentiable grouped GEMM with a fused per-row scale and per-expert bias (see module doc).

    ``backend``: None (decided per call) or one of ``BACKENDS`` (forced; ValueError saying why where it cannot run).
    ``check_offsets``: read offsets' values on the host to validate them (default: only for CPU offsets; on CUDA this
    would sync and break graph capture). ``group_sizes``: the rows of each expert as host ints (list, tuple or CPU
    tensor), when the caller has them anyway (an MoE layer does): the decision sees them and the per-expert loop reads
    no offsets; they must agree with the offsets (checked against the row count, never read from the device)."""
    sizes, _ = validation.check_forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, check_offsets,
                                        group_sizes)
    return GroupedMM.apply(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, backend, _dispatch, sizes)


def grouped_mm_forward(x_TK, w_EKN, offsets_E, *, bias_EN=None, row_scale_T=None, out_dtype=None, backend=None,
                       check_offsets=None, group_sizes=None) -> torch.Tensor:
    """Forward only (no autograd graph): y = row_scale * (x @ w[e]) + bias[e]; arguments as grouped_mm."""
    try:
        (T, K), w_shape = x_TK.shape, w_EKN.shape
        facts = ("fwd", x_TK.__class__, w_EKN.__class__, offsets_E.__class__, x_TK.dtype, x_TK.device, w_EKN.dtype,
                 w_EKN.device, offsets_E.dtype, offsets_E.device, K, w_shape, offsets_E.shape, out_dtype, backend,
                 backend == "cutlass" and w_EKN.stride(), group_sizes is None, _settings.generation, support.generation,
                 bias_EN is None or (bias_EN.__class__, bias_EN.dtype, bias_EN.device, bias_EN.shape),
                 row_scale_T is None or (row_scale_T.__class__, row_scale_T.dtype, row_scale_T.device,
                                         row_scale_T.shape == (T,)))
        run = _HELD["t"].runners.get(facts)
    except Exception:  # noqa: BLE001 - the checks word it
        facts = run = None
    if run is None:  # (the arguments as a tuple only here: a like call passes them on as they came)
        args = (x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype)
        return _dispatch("fwd", args, backend, *validation.check_forward(*args, check_offsets, group_sizes), facts)
    if group_sizes is not None or check_offsets or (check_offsets is None and offsets_E.is_cpu):
        group_sizes = validation.check_rows(offsets_E, w_shape[0], T, check_offsets, group_sizes)
    return run(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, group_sizes)


def grouped_mm_dgrad(dy_TN, w_EKN, offsets_E, *, row_scale_T=None, out_dtype=None, backend=None,
                     check_offsets=None, group_sizes=None, validate: bool = True) -> torch.Tensor:
    """dx = row_scale * (dy @ w[e]^T) for the rows of each expert; arguments as grouped_mm.
    ``validate=False`` skips the checks: only for a backward whose forward validated its operands."""
    if not validate:
        return _dispatch("dgrad", (dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype), backend, group_sizes)
    try:
        (T, N), w_shape = dy_TN.shape, w_EKN.shape
        facts = ("dgrad", dy_TN.__class__, w_EKN.__class__, offsets_E.__class__, dy_TN.dtype, dy_TN.device,
                 w_EKN.dtype, w_EKN.device, offsets_E.dtype, offsets_E.device, N, w_shape, offsets_E.shape, out_dtype,
                 backend, backend == "cutlass" and w_EKN.stride(), group_sizes is None, _settings.generation,
                 support.generation, row_scale_T is None or (row_scale_T.__class__, row_scale_T.dtype,
                                                             row_scale_T.device, row_scale_T.shape == (T,)))
        run = _HELD["t"].runners.get(facts)
    except Exception:  # noqa: BLE001 - the checks word it
        facts = run = None
    if run is None:
        args = (dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype)
        return _dispatch("dgrad", args, backend, *validation.check_dgrad(*args, check_offsets, group_sizes), facts)
    if group_sizes is not None or check_offsets or (check_offsets is None and offsets_E.is_cpu):
        group_sizes = validation.check_rows(offsets_E, w_shape[0], T, check_offsets, group_sizes)
    return run(dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, group_sizes)


def grouped_mm_wgrad(x_TK, dy_TN, offsets_E, *, num_groups: Optional[int] = None, out_dtype=None, backend=None,
                     check_offsets=None, group_sizes=None, validate: bool = True) -> torch.Tensor:
    """dw[e] = x_e^T @ dy_e as [E, K, N], a transposed view of a contiguous [E, N, K] buffer (the
    weight's layout); experts without rows get zeros. Arguments as grouped_mm_dgrad."""
    if num_groups is None:
        num_groups = offsets_E.numel() if isinstance(offsets_E, torch.Tensor) else -1
    if not validate:
        return _dispatch("wgrad", (x_TK, dy_TN, offsets_E, num_groups, out_dtype), backend, group_sizes)
    try:
        (T, K), (dy_T, N) = x_TK.shape, dy_TN.shape
        facts = ("wgrad", x_TK.__class__, dy_TN.__class__, offsets_E.__class__, x_TK.dtype, x_TK.device, dy_TN.dtype,
                 dy_TN.device, offsets_E.dtype, offsets_E.device, K, N, T == dy_T, num_groups.__class__, num_groups,
                 offsets_E.shape, out_dtype, backend, group_sizes is None, _settings.generation, support.generation)
        run = _HELD["t"].runners.get(facts)
    except Exception:  # noqa: BLE001 - the checks word it
        facts = run = None
    if run is None:
        args = (x_TK, dy_TN, offsets_E, num_groups, out_dtype)
        return _dispatch("wgrad", args, backend, *validation.check_wgrad(*args, check_offsets, group_sizes), facts)
    if group_sizes is not None or check_offsets or (check_offsets is None and offsets_E.is_cpu):
        group_sizes = validation.check_rows(offsets_E, num_groups, T, check_offsets, group_sizes)
    return run(x_TK, dy_TN, offsets_E, num_groups, out_dtype, group_sizes)


def select_backend(direction: str, x_TK, w_EKN, *, out_dtype=None, backend=None, group_sizes=None,
                   epilogue: bool = False) -> str:
    """The backend the rule picks for a call with these operands without a measurement (benchmarks,
    logs). ``x_TK``: the call's row operand (dgrad: dy); ``epilogue``: a bias or row scale is given."""
    p = _problem(direction, x_TK, w_EKN.shape, None if direction == "wgrad" else w_EKN.stride(),
                 out_dtype or x_TK.dtype, group_sizes, epilogue)
    return _choose(p, x_TK.device, backend, group_sizes, None)[0]


def describe_choice(direction: str, x_TK, w_EKN, *, out_dtype=None, group_sizes=None, epilogue: bool = False) -> str:
    """What such a call runs and why: ``"cutlass:2 measured"``, ``"torch static"``. Measures nothing."""
    group_sizes = None if group_sizes is None else tuple(group_sizes)
    p = _problem(direction, x_TK, w_EKN.shape, None if direction == "wgrad" else w_EKN.stride(),
                 out_dtype or x_TK.dtype, group_sizes, epilogue)
    t = measure.tuner()
    ms = t.entry(p, x_TK.device.index, group_sizes) if p.device_type == "cuda" and t.enabled else None
    choice = decide.pick_measured(ms, p) if ms else None
    if choice is not None:
        return f"{measure.choice_name(choice)} measured"
    name = _choose(p, x_TK.device, None, group_sizes, None)[0]
    if name == "cutlass":
        ck = cutlass_backend.kernels_module()
        config = ck.choose_config(direction, p.num_rows, *((p.k, p.n) if direction == "dgrad" else (p.n, p.k)),
                                  p.num_groups, None if direction == "wgrad" else group_sizes)
        return f"cutlass:{config} static"
    return f"{name} static"


def available_backends(device) -> list:
    """Backends that can run a bf16 call on ``device`` (ignoring shape constraints): the rule's own
    answer for a bf16 call of 16-byte rows there (on CPU the loop, the rule's choice)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    p = decide.Problem("fwd", device.type, device_capability(device) if cuda else None, torch.bfloat16, torch.bfloat16,
                       0, 8, 8, 1)
    return [b for b in decide.BACKENDS if (cuda or b == "loop") and decide.why_not(
        b, p, cutlass_built=lambda: cutlass_backend.is_available(device), torch_grouped=_TORCH_GROUPED) is None]
