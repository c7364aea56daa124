"""MoELayer agreement across real torchrun ranks (gloo, 2 ranks; the NCCL variant runs on GPU hosts).

One launch runs every scenario of ``workers/layer_agreement_scenarios.py`` back to back; the tests
below check each scenario's results on every rank. A mismatched layer must raise the same
LayerMismatchError on every rank before any all-to-all (counted in the worker), and the group must
stay usable for the next scenario.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import run_torchrun, scenario_results

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).resolve().parent / "workers" / "layer_agreement_scenarios.py"
MISMATCHES = {  # scenario -> (differing fields, a line of the report)
    "experts": (["num_experts"], "num_experts: 4 on rank 0, 8 on rank 1"),
    "hidden": (["hidden_size"], "hidden_size: 16 on rank 0, 32 on rank 1"),
    "ffn": (["ffn_hidden_size"], "ffn_hidden_size: 8 on rank 0, 12 on rank 1"),
    "top_k": (["top_k"], "top_k: 2 on rank 0, 1 on rank 1"),
    "activation": (["activation", "probs_position"], "activation: swiglu on rank 0, gelu on rank 1"),
    "dtype": (["dtype"], "dtype: torch.float32 on rank 0, torch.bfloat16 on rank 1"),
    "recipe_field": (["recipe"], "recipe:\n      use_power_2_scales: False on rank 0, True on rank 1"),
    "recipe_none": (["recipe"], "recipe class: Float8CurrentScaling on rank 0, no recipe on rank 1"),
}
SCENARIOS = ["equal", *MISMATCHES, "midtrain", "all_change", "inf"]


def launch(*extra) -> dict:
    result = run_torchrun(WORKER, 2, args=("--scenarios", ",".join(SCENARIOS), *extra), timeout=240).check()
    results = scenario_results(result.rank_logs)
    assert sorted(results) == sorted(SCENARIOS), result.report()
    return results


@pytest.fixture(scope="module")
def results():
    return launch()


def assert_same_error_everywhere(errors):
    assert all(e is not None for e in errors), f"a rank did not raise: {errors}"
    assert all(e == errors[0] for e in errors), errors
    return errors[0]


def test_equal_layers_agree_once_and_then_ride_on_the_count_exchange(results):
    for payload in results["equal"]:
        assert payload["errors"] == [None] * 3 and payload["finite"] == [True] * 3
        assert payload["transport"] == "all_to_all"
        # one agreement at the first forward; later steps add no collective (3 all-to-alls: counts, tokens, combine)
        assert payload["calls"] == [{"agree": 1, "all_to_all": 3}] + [{"agree": 0, "all_to_all": 3}] * 2


@pytest.mark.parametrize("scenario", list(MISMATCHES))
def test_mismatched_layer_raises_the_same_error_on_every_rank_before_any_transport(results, scenario):
    fields, line = MISMATCHES[scenario]
    per_rank = results[scenario]
    error = assert_same_error_everywhere([p["error"] for p in per_rank])
    assert error["type"] == "LayerMismatchError" and error["mismatched"] == [1]
    assert error["fields"] == fields
    assert "MoELayer mismatch across the 2 ranks of its expert-parallel group: rank 1 differs from rank 0" in error["message"]
    assert line in error["message"], error["message"]
    assert all(p["calls"] == {"agree": 1, "all_to_all": 0} for p in per_rank)  # nothing reached the transport


def test_recipe_changed_on_one_rank_mid_training_fails_every_rank_at_that_step(results):
    per_rank = results["midtrain"]
    for payload in per_rank:
        steps = payload["steps"]
        assert [s["step"] for s in steps] == [0, 1, 2]  # steps 0 and 1 ran, step 2 raised
        assert [s["calls"]["agree"] for s in steps] == [1, 0, 1]  # detected from the tags, then reported
        assert steps[0]["error"] is None and steps[1]["error"] is None
    error = assert_same_error_everywhere([p["steps"][-1]["error"] for p in per_rank])
    assert error["fields"] == ["recipe"] and "use_power_2_scales: False on rank 0, True on rank 1" in error["message"]


def test_recipe_changed_on_every_rank_is_agreed_once_more(results):
    for payload in results["all_change"]:
        steps = payload["steps"]
        assert all(s["error"] is None and s["finite"] for s in steps)
        assert [s["calls"]["agree"] for s in steps] == [1, 0, 1, 0]


def test_inf_routing_input_raises_on_every_rank_and_the_group_recovers(results):
    per_rank = results["inf"]
    for rank, payload in enumerate(per_rank):
        error = payload["error"]
        assert error["type"] == "RoutingError", payload
        assert "router logits contain NaN or inf on EP rank(s) [1]" in error["message"]
        assert f"(this is EP rank {rank})" in error["message"]
        assert payload["after"] is None and payload["finite_after"] is True


@pytest.mark.gpu
def test_nccl_scenarios():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    res = launch("--backend", "nccl")
    for scenario in MISMATCHES:
        if scenario == "dtype":  # on GPUs the layers are bf16, the odd rank fp32
            continue
        error = assert_same_error_everywhere([p["error"] for p in res[scenario]])
        assert error["fields"] == MISMATCHES[scenario][0]
    assert res["dtype"][0]["error"]["fields"] == ["dtype"]
    assert all(s["error"] is None for p in res["all_change"] for s in p["steps"])
