"""Tuning-table agreement across real torchrun ranks (gloo, 2 ranks).

Each rank measured a different winner for the same bucket; after ``agree_tuned_choices`` every
rank uses rank 0's choice, a bucket only another rank measured takes the static table everywhere,
and nothing new is measured (the table is frozen), so ranks never pick different kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import run_torchrun, scenario_results

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).resolve().parent / "workers" / "tune_agreement_scenarios.py"


@pytest.fixture(scope="module")
def results():
    result = run_torchrun(WORKER, 2, timeout=240).check()
    got = scenario_results(result.rank_logs)
    assert sorted(got) == ["after", "before"], result.report()
    return got


def test_ranks_measured_different_winners(results):
    before = results["before"]
    assert before[0]["shared"] == "torch" and before[1]["shared"] == "cutlass:2"


def test_every_rank_uses_rank_0s_choices_after_agreeing(results):
    after = results["after"]
    assert [a["shared"] for a in after] == ["torch", "torch"]
    assert [a["rank0_own"] for a in after] == [after[0]["own"]] * 2  # rank 0's own bucket, on both ranks
    assert after[0]["own"] is not None
    assert after[1]["own"] is None  # only rank 1 measured it: the static table on rank 1 too
    assert [a["count"] for a in after] == [2, 2]


def test_nothing_new_is_measured_after_agreeing(results):
    after = results["after"]
    assert [a["new"] for a in after] == [None, None]
    assert all(a["frozen"] for a in after)
