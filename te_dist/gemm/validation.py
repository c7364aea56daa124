"""Input checks of the grouped-GEMM entry points: every user error, before any launch, worded the
same whichever backend would run.

Checks of offsets' *values* (monotonic, ending at T) read them on the host, so they run for CPU
offsets always and for CUDA offsets only when asked (``check_offsets=True``): reading a GPU tensor
would sync and break graph capture. Nothing here syncs or allocates. The checks sit on every call's
path, so each reads a tensor attribute once and calls no helper for an operand that is absent.

Legend: T tokens (rows), K input features, N output features, E experts (groups).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SUPPORTED_DTYPES", "check_offsets_values", "check_group_sizes", "check_forward", "check_dgrad",
           "check_wgrad", "check_quantized", "check_offsets_tensor", "check_rows"]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FLOATS = frozenset(SUPPORTED_DTYPES)  # a set lookup: every call checks a few dtypes


def _check_tensor(name: str, t, ndim: int, *, floats: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, received {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, received shape {tuple(t.shape)}")
    if floats and t.dtype not in _FLOATS:
        raise TypeError(f"{name}.dtype must be one of {SUPPORTED_DTYPES}, received {t.dtype}")


def _check_same_device(name: str, t: torch.Tensor, ref_name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {device}; they must share a device")


def check_offsets_tensor(offsets_E, num_groups: int, ref_name: str, device: torch.device) -> None:
    """int32 cumulative end rows, one per expert, on the operands' device (values: see module doc)."""
    if not isinstance(offsets_E, torch.Tensor) or len(shape := offsets_E.shape) != 1:
        _check_tensor("offsets_E", offsets_E, 1)
    if offsets_E.dtype != torch.int32:
        raise TypeError(f"offsets_E.dtype must be torch.int32 (cumulative end rows), received {offsets_E.dtype}")
    if offsets_E.device != device:
        _check_same_device("offsets_E", offsets_E, ref_name, device)
    if shape[0] != num_groups:
        raise ValueError(f"offsets_E has {shape[0]} entries but there are {num_groups} experts")


def _check_operands(a_name: str, a, b_name: str, b, b_ndim: int) -> tuple:
    """The row operand ``a`` (2-D floats) and ``b`` (``b_ndim``-D, a's dtype and device); returns the
    device, the dtype and both shapes."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or len(a_shape := a.shape) != 2 \
            or len(b_shape := b.shape) != b_ndim:
        _check_tensor(a_name, a, 2)
        _check_tensor(b_name, b, b_ndim)
    dtype = a.dtype
    if dtype not in _FLOATS:
        raise TypeError(f"{a_name}.dtype must be one of {SUPPORTED_DTYPES}, received {dtype}")
    if b.dtype != dtype:
        raise TypeError(f"{b_name}.dtype must equal {a_name}.dtype={dtype}, received {b.dtype}")
    device = a.device
    if b.device != device:
        _check_same_device(b_name, b, a_name, device)
    return device, dtype, a_shape, b_shape


def check_offsets_values(offsets_E: torch.Tensor, num_rows: int) -> None:
    """Offsets are cumulative END rows: non-decreasing, non-negative, last == num_rows (host read)."""
    ends = offsets_E.tolist()
    for e, (prev, end) in enumerate(zip([0] + ends[:-1], ends)):
        if end < prev:
            raise ValueError(f"offsets_E must be non-decreasing cumulative end rows starting at >= 0; "
                             f"offsets_E[{e}]={end} < previous end {prev} (split size {end - prev} < 0)")
    if not ends and num_rows != 0:
        raise ValueError(f"no experts (offsets_E is empty) but {num_rows=} rows were given")
    if ends and ends[-1] != num_rows:
        raise ValueError(f"offsets_E must end at the number of rows: offsets_E[-1]={ends[-1]} != {num_rows=}")


_last_sizes = (None, 0, 0)  # (the last tuple that passed, its groups, its rows): one entry, replaced whole


def check_group_sizes(group_sizes, num_groups: int, num_rows: int) -> tuple:
    """The optional host copy of the split sizes: ``num_groups`` non-negative ints summing to
    ``num_rows``, returned as a tuple. The offsets are not read to compare (no sync). The six GEMMs
    of one MLP step pass the same tuple: the last one that passed is remembered by identity (a tuple
    cannot change), so a scan of E sizes runs once per step, not per GEMM."""
    global _last_sizes
    if _last_sizes[0] is group_sizes and _last_sizes[1] == num_groups and _last_sizes[2] == num_rows:
        return group_sizes
    given = group_sizes
    if isinstance(group_sizes, torch.Tensor):
        if not group_sizes.is_cpu:
            raise TypeError("group_sizes must be host ints (a list, tuple or CPU tensor), "
                            f"received a tensor on {group_sizes.device}")
        group_sizes = group_sizes.tolist()
    if not isinstance(group_sizes, (list, tuple)) or not all(type(v) is int for v in group_sizes):
        raise TypeError(f"group_sizes must be a list or tuple of ints (rows per group), received {group_sizes!r}")
    if len(group_sizes) != num_groups:
        raise ValueError(f"group_sizes has {len(group_sizes)} entries but there are {num_groups} experts")
    if group_sizes and min(group_sizes) < 0:
        raise ValueError(f"group_sizes must be non-negative, received {list(group_sizes)}")
    if sum(group_sizes) != num_rows:
        raise ValueError(f"group_sizes sum to {sum(group_sizes)} but there are {num_rows} rows")
    group_sizes = tuple(group_sizes)
    if given.__class__ is tuple:
        _last_sizes = (group_sizes, num_groups, num_rows)
    return group_sizes


def check_rows(offsets_E, num_groups: int, num_rows: int, check_offsets: Optional[bool], group_sizes):
    """The offsets' values where they are read (module doc), then the host sizes as a tuple (or None)."""
    if check_offsets or (check_offsets is None and offsets_E.is_cpu):
        check_offsets_values(offsets_E, num_rows)
    return None if group_sizes is None else check_group_sizes(group_sizes, num_groups, num_rows)


def _check_row_scale_and_out_dtype(row_scale_T, rows_name, T, device, out_dtype) -> None:
    """The optional per-row scale ([T] floats beside the ``T`` rows of ``rows_name``) and the output dtype."""
    if row_scale_T is not None:
        _check_tensor("row_scale_T", row_scale_T, 1, floats=True)
        _check_same_device("row_scale_T", row_scale_T, rows_name, device)
        if row_scale_T.shape[0] != T:
            raise ValueError(f"row_scale_T must have T={T} entries, received {row_scale_T.shape[0]}")
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise TypeError(f"out_dtype must be None or one of {SUPPORTED_DTYPES}, received {out_dtype}")


def check_forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, check_offsets=None, group_sizes=None):
    """Every check of a forward call; returns the host sizes as a tuple (or None) and (device, dtype, w's shape)."""
    device, dtype, (T, x_K), (E, K, N) = _check_operands("x_TK", x_TK, "w_EKN", w_EKN, 3)
    if x_K != K:
        raise ValueError(f"x_TK has K={x_K} columns but w_EKN expects K={K} (w_EKN shape {(E, K, N)})")
    check_offsets_tensor(offsets_E, E, "x_TK", device)
    if bias_EN is not None:
        _check_tensor("bias_EN", bias_EN, 2, floats=True)
        _check_same_device("bias_EN", bias_EN, "x_TK", device)
        if tuple(bias_EN.shape) != (E, N):
            raise ValueError(f"bias_EN must have shape {(E, N)}, received {tuple(bias_EN.shape)}")
    if row_scale_T is not None or out_dtype is not None:
        _check_row_scale_and_out_dtype(row_scale_T, "x_TK", T, device, out_dtype)
    return check_rows(offsets_E, E, T, check_offsets, group_sizes), (device, dtype, (E, K, N))


def check_dgrad(dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, check_offsets=None, group_sizes=None):
    """Every check of a dgrad call; returns what check_forward does."""
    device, dtype, (T, dy_N), (E, K, N) = _check_operands("dy_TN", dy_TN, "w_EKN", w_EKN, 3)
    if dy_N != N:
        raise ValueError(f"dy_TN has N={dy_N} columns but w_EKN expects N={N}")
    check_offsets_tensor(offsets_E, E, "dy_TN", device)
    if row_scale_T is not None or out_dtype is not None:
        _check_row_scale_and_out_dtype(row_scale_T, "dy_TN", T, device, out_dtype)
    return check_rows(offsets_E, E, T, check_offsets, group_sizes), (device, dtype, (E, K, N))


def check_wgrad(x_TK, dy_TN, offsets_E, num_groups, out_dtype, check_offsets=None, group_sizes=None):
    """Every check of a wgrad call; returns what check_forward does (the shape: dw's [E, K, N])."""
    device, dtype, (T, K), (dy_T, N) = _check_operands("x_TK", x_TK, "dy_TN", dy_TN, 2)
    if dy_T != T:
        raise ValueError(f"dy_TN has {dy_T} rows but x_TK has {T}")
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative int, received {num_groups!r}")
    check_offsets_tensor(offsets_E, num_groups, "x_TK", device)
    _check_row_scale_and_out_dtype(None, "x_TK", T, device, out_dtype)
    return check_rows(offsets_E, num_groups, T, check_offsets, group_sizes), (device, dtype, (num_groups, K, N))


def check_quantized(name: str, q, ndim: int) -> None:
    """An operand of the quantized entry points: a quantized tensor or a prepared weight of ``ndim`` dims."""
    from ..quantization.tensors import QuantizedTensor
    from .fp8_operands import QuantizedWeight

    if not isinstance(q, (QuantizedTensor, QuantizedWeight)):
        raise TypeError(f"{name} must be a quantized tensor (te_dist.quantization), received {type(q).__name__}")
    if len(q.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, received shape {tuple(q.shape)}")
