"""Tensor-parallel BasicLinear and the communication ops under torchrun (2 ranks, gloo)."""

from pathlib import Path

import pytest

from harness import run_torchrun

WORKER = Path(__file__).parent / "workers" / "tp_linear.py"


@pytest.mark.multiprocess
def test_tensor_parallel_linear_and_comm_ops():
    result = run_torchrun(WORKER, 2, args=("column", "row", "mlp", "comm"), timeout=240).check()
    for rank in (0, 1):
        for name in ("column", "row", "mlp", "comm"):
            assert f"rank {rank}: {name} OK" in result.log(rank), result.report()
