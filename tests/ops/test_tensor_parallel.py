"""Tensor-parallel BasicLinear, the communication ops and DelayedScaling amax reduction under torchrun
(2 ranks, gloo)."""

from pathlib import Path

import pytest

from harness import run_torchrun

WORKER = Path(__file__).parent / "workers" / "tp_linear.py"


@pytest.mark.multiprocess
def test_tensor_parallel_linear_and_comm_ops():
    names = ("column", "row", "mlp", "comm", "amax")
    result = run_torchrun(WORKER, 2, args=names, timeout=240).check()
    for rank in (0, 1):
        for name in names:
            assert f"rank {rank}: {name} OK" in result.log(rank), result.report()
