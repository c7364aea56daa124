"""ctypes view of ``peer_rows.cu`` (the expert-parallel row moves), built on first use like the GEMMs.

Only pointers and integers cross this boundary; ``rows.py`` owns the tensors, the symmetric memory
and the barriers. The build and the disk cache are cutlass_kernels' (``build.open_plain_source``),
imported on first use so that ``import te_dist`` never needs them.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

__all__ = ["SOURCE", "PeerRowsLibrary", "load_peer_rows"]

SOURCE = Path(__file__).resolve().parent / "peer_rows.cu"


_NOT_READY = 600  # cudaErrorNotReady: te_pr_wait_counts's slice ended before the flag came
_WAIT_SLICE_NS = 100_000_000


class PeerRowsLibrary:
    """The launches of peer_rows.cu; each raises RuntimeError naming the CUDA error."""

    def __init__(self, path: Path):
        c = ctypes
        lib = ctypes.CDLL(str(path))
        lib.te_pr_last_error.restype = c.c_char_p
        lib.te_pr_plan.restype = c.c_int
        lib.te_pr_plan.argtypes = [c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_void_p, c.c_void_p, c.c_void_p,
                                   c.c_void_p, c.c_void_p]
        lib.te_pr_move.restype = c.c_int
        lib.te_pr_move.argtypes = [c.c_int, c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_int64, c.c_void_p,
                                   c.c_void_p, c.c_int, c.c_int, c.c_void_p, c.c_int, c.c_void_p]
        lib.te_pr_barrier.restype = c.c_int
        lib.te_pr_barrier.argtypes = [c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_uint64, c.c_void_p]
        lib.te_pr_exchange.restype = c.c_int
        lib.te_pr_exchange.argtypes = [c.c_void_p, c.c_int, c.c_int, c.c_uint64, c.c_void_p, c.c_int, c.c_void_p,
                                       c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p,
                                       c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p]
        lib.te_pr_wait_counts.restype = c.c_int
        lib.te_pr_wait_counts.argtypes = [c.c_void_p, c.c_int64, c.c_void_p, c.c_int64]
        lib.te_pr_new_event.restype = c.c_int
        lib.te_pr_new_event.argtypes = [c.c_void_p]
        lib.te_pr_device_address.restype = c.c_int
        lib.te_pr_device_address.argtypes = [c.c_void_p, c.c_void_p]
        self._lib = lib
        self.path = path

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"peer_rows kernel launch failed: {self._lib.te_pr_last_error().decode(errors='replace')}")

    def plan(self, matrix, world, num_experts, rank, block_end, src_base, local_sizes, local_offsets, stream) -> None:
        self._check(self._lib.te_pr_plan(matrix, world, num_experts, rank, block_end, src_base, local_sizes,
                                         local_offsets, stream))

    def barrier(self, pads, channel, rank, world, timeout_ns, stream) -> None:
        self._check(self._lib.te_pr_barrier(pads, channel, rank, world, timeout_ns, stream))

    def exchange(self, *args) -> None:
        """te_pr_exchange: the count exchange's device sequence (peer_rows.cu has the argument order)."""
        self._check(self._lib.te_pr_exchange(*args))

    def wait_counts(self, host_flag, seq, event) -> None:
        """Spin until the pinned ``host_flag`` holds ``seq`` (te_pr_exchange's last write), in slices
        of 0.1 s, so that Python handles signals (Ctrl-C) between them."""
        rc = _NOT_READY
        while rc == _NOT_READY:
            rc = self._lib.te_pr_wait_counts(host_flag, seq, event, _WAIT_SLICE_NS)
        self._check(rc)

    def new_event(self) -> int:
        """A CUDA event (on the current device) for te_pr_exchange to record; lives as long as the process."""
        event = ctypes.c_void_p()
        self._check(self._lib.te_pr_new_event(ctypes.byref(event)))
        return event.value

    def device_address(self, host: int) -> int:
        """The device's address of pinned host memory at ``host`` (raises if it is not pinned)."""
        address = ctypes.c_void_p()
        self._check(self._lib.te_pr_device_address(host, ctypes.byref(address)))
        return address.value

    def move(self, push, a, a_bytes, b, b_bytes, num_rows, block_end, src_base, blocks, world, peer_rows, max_blocks,
             stream) -> None:
        """Pull (``push`` false) or push this rank's received rows: local column blocks ``a`` and ``b``
        (``b_bytes`` may be 0) against the senders' rows regions (peer_rows.cu, "Layout")."""
        self._check(self._lib.te_pr_move(int(push), a, a_bytes, b, b_bytes, num_rows, block_end, src_base, blocks,
                                         world, peer_rows, max_blocks, stream))


_lock = threading.Lock()
_loaded: list = []


def load_peer_rows() -> PeerRowsLibrary:
    """The library, compiled into the kernel cache on first use (raises cutlass_kernels' BuildError
    without nvcc, or when the library fails to load even after a rebuild)."""
    if not _loaded:
        from cutlass_kernels.build import open_plain_source

        with _lock:
            if not _loaded:
                _loaded.append(open_plain_source(SOURCE, PeerRowsLibrary))
    return _loaded[0]

