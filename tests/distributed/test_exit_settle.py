"""A rank exits 0 after gloo collectives (te_dist.distributed.exit_settle), not SIGABRT.

The worker leaves a gloo worker thread waiting for the GIL when its interpreter finishes, every
time (workers/exit_after_collective.py says how). Without te_dist's exit hook the rank aborts:
that control keeps the reproduction honest, so the fixed run proves the hook and not luck.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import run_torchrun, scenario_results

WORKER = Path(__file__).resolve().parent / "workers" / "exit_after_collective.py"
ABORT = "terminate called without an active exception"

PROBE = """
import gc, sys, time
import torch.distributed as dist
from te_dist.distributed.exit_settle import collective_threads_alive
seen = [collective_threads_alive()]
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
deadline = time.monotonic() + 10  # a new thread names itself once it runs: on a loaded machine, a moment later
while not collective_threads_alive() and time.monotonic() < deadline:
    time.sleep(0.02)
seen.append(collective_threads_alive())
dist.destroy_process_group()
gc.collect()
seen.append(collective_threads_alive())
print(seen)
"""


def test_the_hook_sees_a_gloo_groups_threads_while_the_group_lives(tmp_path):
    # In a fresh interpreter: groups other tests left alive in this one would answer too.
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "store")], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[False, True, False]", out  # after the destroy the threads are joined: no pause


@pytest.mark.multiprocess
def test_without_the_exit_hook_the_rank_aborts():
    result = run_torchrun(WORKER, 2, args=("--without",), timeout=120)
    assert not result.timed_out, result.report()
    assert result.returncode != 0 and ABORT in result.log(0), (
        "the reproduction no longer aborts without te_dist's exit hook (has torch fixed the race? then "
        "te_dist/distributed/exit_settle.py may go):\n" + result.report())


@pytest.mark.multiprocess
def test_with_te_dist_imported_every_rank_exits_0():
    result = run_torchrun(WORKER, 2, args=("--with-te-dist",), timeout=120).check()
    results = scenario_results(result.rank_logs)
    assert results["holds_the_gil"][0] is True and results["sum"][1] == 2.0, result.report()
    assert all(ABORT not in result.log(rank) for rank in (0, 1)), result.report()
