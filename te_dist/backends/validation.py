"""Input checks for the grouped GEMM entry points.

Why here and not in each backend: every error must be raised before any kernel launch, with the
same wording whichever backend would have run. Checks that need offsets' *values* (monotonic,
ending at T) read them on the host, so they run for CPU offsets always and for CUDA offsets only
when asked (``check_offsets=True``): reading a GPU tensor would sync and break graph capture.

Legend: T tokens (rows), K input features, N output features, E experts (groups).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "check_offsets_values",
    "check_group_sizes",
    "check_forward",
    "check_dgrad",
    "check_wgrad",
]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, received {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, received shape {tuple(t.shape)}")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}.dtype must be one of {SUPPORTED_DTYPES}, received {t.dtype}")


def _check_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.is_cpu and ref.is_cpu:  # the common CPU case without building two torch.device objects
        return
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; they must share a device")


def _check_offsets(offsets_E: torch.Tensor, num_groups: int, ref_name: str, ref: torch.Tensor) -> None:
    _check_tensor("offsets_E", offsets_E, 1)
    if offsets_E.dtype != torch.int32:
        raise TypeError(f"offsets_E.dtype must be torch.int32 (cumulative end rows), received {offsets_E.dtype}")
    _check_same_device("offsets_E", offsets_E, ref_name, ref)
    if offsets_E.numel() != num_groups:
        raise ValueError(f"offsets_E has {offsets_E.numel()} entries but there are {num_groups} experts")


def check_offsets_values(offsets_E: torch.Tensor, num_rows: int) -> None:
    """Offsets are cumulative END rows: non-decreasing, non-negative, last == num_rows (host read)."""
    if offsets_E.numel() == 0:
        if num_rows != 0:
            raise ValueError(f"no experts (offsets_E is empty) but {num_rows=} rows were given")
        return
    ends = offsets_E.tolist()
    prev = 0
    for e, end in enumerate(ends):
        if end < prev:
            raise ValueError(
                f"offsets_E must be non-decreasing cumulative end rows starting at >= 0; "
                f"offsets_E[{e}]={end} < previous end {prev} (split size {end - prev} < 0)"
            )
        prev = end
    if ends[-1] != num_rows:
        raise ValueError(f"offsets_E must end at the number of rows: offsets_E[-1]={ends[-1]} != {num_rows=}")


def check_group_sizes(group_sizes, num_groups: int, num_rows: int) -> tuple:
    """The optional host copy of the split sizes (rows per group): ``num_groups`` non-negative ints
    summing to ``num_rows``. Returned as a tuple. The offsets are not read to compare (no sync): a
    caller that passes both vouches that they agree."""
    if isinstance(group_sizes, torch.Tensor):
        if not group_sizes.is_cpu:
            raise TypeError("group_sizes must be host ints (a list, tuple or CPU tensor), "
                            f"received a tensor on {group_sizes.device}")
        group_sizes = group_sizes.tolist()
    ints = isinstance(group_sizes, (list, tuple)) and all(type(v) is int for v in group_sizes)
    if not ints:
        raise TypeError(f"group_sizes must be a list or tuple of ints (rows per group), received {group_sizes!r}")
    if len(group_sizes) != num_groups:
        raise ValueError(f"group_sizes has {len(group_sizes)} entries but there are {num_groups} experts")
    if group_sizes and min(group_sizes) < 0:
        raise ValueError(f"group_sizes must be non-negative, received {list(group_sizes)}")
    if sum(group_sizes) != num_rows:
        raise ValueError(f"group_sizes sum to {sum(group_sizes)} but there are {num_rows} rows")
    return tuple(group_sizes)


def _maybe_check_values(offsets_E, num_rows, check_offsets: Optional[bool]) -> None:
    if check_offsets is None:
        check_offsets = offsets_E.is_cpu
    if check_offsets:
        check_offsets_values(offsets_E, num_rows)


def check_forward(x_TK, w_EKN, offsets_E, bias_EN, row_scale_T, out_dtype, check_offsets=None) -> None:
    _check_tensor("x_TK", x_TK, 2)
    _check_tensor("w_EKN", w_EKN, 3)
    _check_float("x_TK", x_TK)
    if w_EKN.dtype != x_TK.dtype:
        raise TypeError(f"w_EKN.dtype must equal x_TK.dtype={x_TK.dtype}, received {w_EKN.dtype}")
    _check_same_device("w_EKN", w_EKN, "x_TK", x_TK)
    E, K, N = w_EKN.shape
    if x_TK.shape[1] != K:
        raise ValueError(f"x_TK has K={x_TK.shape[1]} columns but w_EKN expects K={K} (w_EKN shape {tuple(w_EKN.shape)})")
    _check_offsets(offsets_E, E, "x_TK", x_TK)
    if bias_EN is not None:
        _check_tensor("bias_EN", bias_EN, 2)
        _check_float("bias_EN", bias_EN)
        _check_same_device("bias_EN", bias_EN, "x_TK", x_TK)
        if tuple(bias_EN.shape) != (E, N):
            raise ValueError(f"bias_EN must have shape {(E, N)}, received {tuple(bias_EN.shape)}")
    _check_row_scale_and_out_dtype(row_scale_T, "x_TK", x_TK, out_dtype)
    _maybe_check_values(offsets_E, x_TK.shape[0], check_offsets)


def _check_row_scale_and_out_dtype(row_scale_T, rows_name, rows, out_dtype) -> None:
    """The optional per-row scale ([T] floats beside ``rows``) and the output dtype."""
    if row_scale_T is not None:
        _check_tensor("row_scale_T", row_scale_T, 1)
        _check_float("row_scale_T", row_scale_T)
        _check_same_device("row_scale_T", row_scale_T, rows_name, rows)
        if row_scale_T.shape[0] != rows.shape[0]:
            raise ValueError(f"row_scale_T must have T={rows.shape[0]} entries, received {row_scale_T.shape[0]}")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype must be None or one of {SUPPORTED_DTYPES}, received {out_dtype}")


def check_dgrad(dy_TN, w_EKN, offsets_E, row_scale_T, out_dtype, check_offsets=None) -> None:
    _check_tensor("dy_TN", dy_TN, 2)
    _check_tensor("w_EKN", w_EKN, 3)
    _check_float("dy_TN", dy_TN)
    if w_EKN.dtype != dy_TN.dtype:
        raise TypeError(f"w_EKN.dtype must equal dy_TN.dtype={dy_TN.dtype}, received {w_EKN.dtype}")
    _check_same_device("w_EKN", w_EKN, "dy_TN", dy_TN)
    E, K, N = w_EKN.shape
    if dy_TN.shape[1] != N:
        raise ValueError(f"dy_TN has N={dy_TN.shape[1]} columns but w_EKN expects N={N}")
    _check_offsets(offsets_E, E, "dy_TN", dy_TN)
    _check_row_scale_and_out_dtype(row_scale_T, "dy_TN", dy_TN, out_dtype)
    _maybe_check_values(offsets_E, dy_TN.shape[0], check_offsets)


def check_wgrad(x_TK, dy_TN, offsets_E, num_groups, out_dtype, check_offsets=None) -> None:
    _check_tensor("x_TK", x_TK, 2)
    _check_tensor("dy_TN", dy_TN, 2)
    _check_float("x_TK", x_TK)
    if dy_TN.dtype != x_TK.dtype:
        raise TypeError(f"dy_TN.dtype must equal x_TK.dtype={x_TK.dtype}, received {dy_TN.dtype}")
    _check_same_device("dy_TN", dy_TN, "x_TK", x_TK)
    if dy_TN.shape[0] != x_TK.shape[0]:
        raise ValueError(f"dy_TN has {dy_TN.shape[0]} rows but x_TK has {x_TK.shape[0]}")
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative int, received {num_groups!r}")
    _check_offsets(offsets_E, num_groups, "x_TK", x_TK)
    _check_row_scale_and_out_dtype(None, "x_TK", x_TK, out_dtype)
    _maybe_check_values(offsets_E, x_TK.shape[0], check_offsets)
