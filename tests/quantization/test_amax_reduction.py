"""Amax reduction across real torchrun ranks (gloo): MAX over the group only when asked for."""

import json
from pathlib import Path

import pytest

from harness import run_torchrun

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).resolve().parent / "workers" / "amax_reduce.py"


def _results(result, nproc):
    out = {}
    for rank in range(nproc):
        lines = [l for l in result.log(rank).splitlines() if l.startswith("RESULT ")]
        assert len(lines) == 1, result.report()
        out[rank] = json.loads(lines[0][len("RESULT "):])
    return out


@pytest.mark.parametrize("nproc", [2])
def test_delayed_scaling_amax_is_max_reduced(nproc):
    result = run_torchrun(WORKER, nproc, timeout=180).check()
    results = _results(result, nproc)
    global_amax = 2.0 * nproc
    for rank, r in results.items():
        own_amax = 2.0 * (rank + 1)
        assert r["world"] == nproc
        assert r["reduced_history0"] == global_amax
        assert r["reduced_scale"] == pytest.approx(448.0 / global_amax)
        assert r["local_scale"] == pytest.approx(448.0 / own_amax)  # reduce_amax=False
        assert r["no_group_scale"] == pytest.approx(448.0 / own_amax)  # no group given
        assert r["single_scale"] == pytest.approx(448.0 / own_amax)  # one-rank group
        assert r["current_scale_inv"] == pytest.approx(global_amax / 448.0)
