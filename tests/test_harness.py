"""The multi-process harness itself: per-rank logs, failure propagation, hang timeout."""

import subprocess
import time
from pathlib import Path

import pytest

from harness import run_torchrun

WORKER = Path(__file__).parent / "workers" / "harness_probe.py"


@pytest.mark.multiprocess
def test_every_rank_log_is_captured():
    result = run_torchrun(WORKER, 2, timeout=120).check()
    assert "rank=0 world=2 sum=1" in result.log(0)
    assert "rank=1 world=2 sum=1" in result.log(1)


@pytest.mark.multiprocess
def test_failing_rank_fails_with_its_error():
    result = run_torchrun(WORKER, 2, args=["fail"], timeout=120)
    assert not result.ok
    assert "planned failure on rank 1" in result.log(1)
    with pytest.raises(AssertionError, match="planned failure"):
        result.check()


@pytest.mark.multiprocess
def test_hang_is_killed_at_timeout():
    result = run_torchrun(WORKER, 2, args=["hang"], timeout=20)
    assert result.timed_out and not result.ok
    time.sleep(1)
    leftovers = subprocess.run(["pgrep", "-f", f"{WORKER.name} hang"], capture_output=True, text=True).stdout
    assert leftovers.strip() == "", f"hung workers survived the timeout: pids {leftovers.split()}"
