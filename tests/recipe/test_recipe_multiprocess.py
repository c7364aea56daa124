"""Recipe strings are identical across processes (no addresses, no hash randomisation)."""

from pathlib import Path

import pytest

from harness import run_torchrun

WORKER = Path(__file__).parents[1] / "workers" / "recipe_strings.py"


@pytest.mark.multiprocess
def test_strings_identical_across_two_ranks():
    result = run_torchrun(WORKER, 2, timeout=120, env={"PYTHONHASHSEED": "random"}).check()
    for rank in (0, 1):
        assert "IDENTICAL 5 DelayedScaling(margin=1" in result.log(rank)
    assert "amax_compute_algo=builtins.max" in result.log(0)
