"""Recipe consensus across real torchrun ranks (gloo here; the NCCL variants run on GPU hosts).

One launch per world size runs every scenario of ``workers/consensus_scenarios.py`` back to back
(2 CPU cores: each launch costs seconds); the tests below then check each scenario's results on
every rank. Mismatch scenarios must have raised on EVERY rank with the same readable report.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness import REPO_ROOT, run_torchrun, scenario_results as parse_results

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).resolve().parent / "workers" / "consensus_scenarios.py"
SCENARIOS = "equal,class,field,attr,none,two_groups_of_ranks,midtrain,recover,subgroups,hang"
DEAD_TIMEOUT_S = 4.0


def launch(nproc: int, scenarios: str, *extra) -> dict:
    args = ("--scenarios", scenarios, "--dead-timeout", DEAD_TIMEOUT_S, *extra)
    result = run_torchrun(WORKER, nproc, args=args, timeout=240).check()
    return parse_results(result.rank_logs)


@pytest.fixture(scope="module", params=[(2, False), (4, False), (4, True)], ids=["2ranks", "4ranks", "4ranks-sidegroup"])
def results(request):
    """(nproc, results); "sidegroup" runs consensus on a separate gloo group, as it does for NCCL groups."""
    nproc, side_group = request.param
    return nproc, launch(nproc, SCENARIOS, *(["--side-group"] if side_group else []))


def assert_mismatch_everywhere(per_rank, expected_ranks, *fragments):
    """Every rank raised, with the same report, naming the ranks and the differing settings."""
    errors = [p["error"] if p and "error" in p else None for p in per_rank]
    assert all(e is not None for e in errors), f"a rank did not raise: {per_rank}"
    assert all(e["message"] == errors[0]["message"] for e in errors), errors
    assert errors[0]["mismatched"] == expected_ranks
    message = errors[0]["message"]
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from:\n{message}"
    return message


def test_equal_recipes_built_independently_agree(results):
    nproc, res = results
    keys = [p["keys"] for p in res["equal"]]
    assert len(keys) == nproc and all(k == keys[0] for k in keys)
    assert len(keys[0]) == 5 and len(set(keys[0])) == 5  # one per recipe class, all distinct
    assert "enable_fused_grouped_mlp=False" in keys[0][0]


def test_different_class_is_reported_on_every_rank(results):
    nproc, res = results
    last = nproc - 1
    assert_mismatch_everywhere(
        res["class"], [last], "recipe class: DelayedScaling on rank 0, Float8CurrentScaling on rank " + str(last)
    )


def test_changed_field_is_reported_on_every_rank(results):
    nproc, res = results
    message = assert_mismatch_everywhere(res["field"], [nproc - 1], f"margin: 0 on rank 0, 3 on rank {nproc - 1}")
    assert "fp8_format" not in message  # only the differing setting is listed


def test_attached_attribute_on_one_rank_is_reported(results):
    nproc, res = results
    assert_mismatch_everywhere(
        res["attr"], [nproc - 1], f"enable_cutedsl_fused_grouped_mlp: not set on rank 0, True on rank {nproc - 1}"
    )


def test_recipe_on_some_ranks_and_none_on_others_is_a_mismatch(results):
    nproc, res = results
    assert_mismatch_everywhere(res["none"], [nproc - 1], f"MXFP8BlockScaling on rank 0, no recipe on rank {nproc - 1}")


def test_several_differing_ranks_are_each_reported(results):
    nproc, res = results
    if nproc == 2:  # rank 1 is also the last rank: both changes land on it
        assert_mismatch_everywhere(res["two_groups"], [1], "margin: 0 on rank 0, 2 on rank 1", "fp8_format")
        return
    message = assert_mismatch_everywhere(res["two_groups"], [1, nproc - 1], "ranks 1, 3 differ")
    assert "rank 1 vs rank 0:\n    margin: 0 on rank 0, 2 on rank 1" in message
    assert f"rank {nproc - 1} vs rank 0:\n    fp8_format: Format.HYBRID on rank 0, Format.E4M3 on rank {nproc - 1}" in message


def test_change_mid_training_on_one_rank_fails_every_rank_at_next_step(results):
    nproc, res = results
    per_rank = res["midtrain"]
    assert [p["failed_at"] for p in per_rank] == [3] * nproc  # changed inside step 2, caught entering step 3
    keys = [p["keys"] for p in per_rank]
    assert all(k == keys[0] for k in keys) and len(keys[0]) == 3  # no rank switched plans mid-block
    assert_mismatch_everywhere(per_rank, [nproc - 1], f"use_power_2_scales: False on rank 0, True on rank {nproc - 1}")


def test_group_still_agrees_after_mismatches(results):
    nproc, res = results
    assert all(p["same"] for p in res["recover"])
    assert res["recover"][0]["key"].startswith("NVFP4BlockScaling(")


def test_subgroups_agree_separately_and_fail_separately(results):
    nproc, res = results
    per_rank = res["subgroups"]
    last = nproc - 1
    for rank, payload in enumerate(per_rank):
        assert f"margin={rank // 2}," in payload["key"]  # each pair agreed on its own recipe
        if last in payload["pair"]:
            local = payload["pair"].index(last)
            name = f"rank {local}" if local == last else f"rank {local} (global {last})"
            assert payload["error"] is not None, payload
            assert f"amax_compute_algo: 'max' on rank 0" in payload["error"]["message"]
            assert name in payload["error"]["message"]
        else:
            assert payload["error"] is None, payload  # the healthy pair is not disturbed


def test_absent_rank_makes_the_others_fail_within_the_timeout(results):
    nproc, res = results
    survivors = [p for p in res["hang"] if not p["victim"]]
    assert len(survivors) == nproc - 1
    for p in survivors:
        assert p["elapsed"] is not None, p
        assert p["elapsed"] < DEAD_TIMEOUT_S + 5.0
        assert "recipe consensus failed" in p["message"] and f"timeout {DEAD_TIMEOUT_S:g}s" in p["message"]


# --------------------------------------------------------------------------- a killed rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("nproc", [2, 4])
def test_killed_rank_makes_the_others_fail_within_the_timeout(nproc, tmp_path):
    """Plain processes, not torchrun: torchrun would tear the survivors down before they could report."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(nproc),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(WORKER), "--scenarios", "killed", "--dead-timeout", str(DEAD_TIMEOUT_S),
           "--kill-grace", "3"]
    logs = [tmp_path / f"rank{r}.log" for r in range(nproc)]
    procs = []
    try:
        for rank in range(nproc):
            with open(logs[rank], "w") as out:
                procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 120
        while not all("READY" in p.read_text() for p in logs):
            assert time.monotonic() < deadline, "ranks never got ready:\n" + "\n".join(p.read_text() for p in logs)
            assert all(p.poll() is None for p in procs), "a rank exited early:\n" + "\n".join(p.read_text() for p in logs)
            time.sleep(0.1)
        procs[-1].send_signal(signal.SIGKILL)  # the victim dies while the survivors wait to sync
        killed_at = time.monotonic()
        for proc in procs[:-1]:
            proc.wait(timeout=60)
        survivors_done = time.monotonic() - killed_at
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    texts = [p.read_text() for p in logs]
    results = parse_results(dict(enumerate(texts[:-1])))["killed"]
    for rank, payload in enumerate(results):
        assert payload is not None and payload["elapsed"] is not None, texts[rank]
        assert payload["elapsed"] < DEAD_TIMEOUT_S + 5.0, payload
        assert "recipe consensus failed" in payload["message"], payload
    assert [p.returncode for p in procs[:-1]] == [0] * (nproc - 1), texts
    assert survivors_done < 3 + DEAD_TIMEOUT_S + 20.0


# --------------------------------------------------------------------------- grouped-MLP fusion keys


@pytest.mark.parametrize("nproc", [2, 4])
def test_grouped_mlp_fusion_keys_identical_on_every_rank(nproc):
    res = launch(nproc, "grouped_mlp")["grouped_mlp"]
    keys = [p["fusion_keys"] for p in res]
    assert len(keys) == nproc and all(k == keys[0] for k in keys)
    recipe_key, first_backward = keys[0][0]
    assert recipe_key.startswith("Float8CurrentScaling(") and "enable_fused_grouped_mlp=True" in recipe_key
    assert keys[0][1] == keys[0][0]  # steady state: same key on the second step
    assert all(p["describe"] == res[0]["describe"] for p in res)  # the same plan on every rank
    assert_mismatch_everywhere(res, [nproc - 1], f"enable_fused_grouped_mlp: True on rank 0, False on rank {nproc - 1}")
    assert all(p["key_after_error"] == keys[0][1] for p in res)  # no rank ran a step with another key


# --------------------------------------------------------------------------- NCCL (GPU hosts)


def _need_gpus(n):
    import torch

    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, found {torch.cuda.device_count()}")


@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [2])
def test_nccl_scenarios(nproc):
    _need_gpus(nproc)
    res = launch(nproc, SCENARIOS, "--backend", "nccl")
    assert all(p["same"] for p in res["recover"])
    assert [p["failed_at"] for p in res["midtrain"]] == [3] * nproc
    for name in ("class", "field", "attr", "none"):
        assert_mismatch_everywhere(res[name], [nproc - 1])
    assert all(p["elapsed"] is not None for p in res["hang"] if not p["victim"])


@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [2])
def test_nccl_grouped_mlp_fusion_keys(nproc):
    _need_gpus(nproc)
    res = launch(nproc, "grouped_mlp", "--backend", "nccl")["grouped_mlp"]
    assert all(p["fusion_keys"] == res[0]["fusion_keys"] for p in res)
