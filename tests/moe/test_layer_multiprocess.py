"""MoELayer expert parallelism across real torchrun ranks: EP=N equals EP=1, checkpoints move.

Each launch runs several scenarios to keep the number of process start-ups small (2 CPU cores).
"""

from pathlib import Path

import pytest

from harness import run_torchrun

WORKER = Path(__file__).parent / "workers" / "moe_worker.py"


def _assert_ok(result, nproc, scenarios, ep_sizes):
    for rank in range(nproc):
        log = result.log(rank)
        for ep in ep_sizes:
            for scenario in scenarios:
                assert f"rank={rank} ep={ep} scenario={scenario} ok" in log, f"missing {scenario} at EP={ep}:\n{log}"


@pytest.mark.multiprocess
def test_ep2_ep4_equal_ep1_and_checkpoint_moves_between_ep_sizes(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("moe_ckpt_ep2")
    scenarios = ["equivalence", "sigmoid", "skewed", "one_expert", "empty"]
    result = run_torchrun(WORKER, 2, args=[",".join(scenarios) + f",save:{ckpt}"], timeout=240).check()
    _assert_ok(result, 2, scenarios + ["equivalence-combine"], [2])
    # skewed routing: rank 1 owns experts 4..7 and must have received nothing
    assert "rank=1 ep=2 scenario=skewed ok (routed 12, received 0 rows)" in result.log(1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["rank0.pt", "rank1.pt"]
    # 4 ranks: EP=4 and EP=2 (x EDP=2) equal EP=1; the EP=2 checkpoint loads at EP=4 and at EP=1
    result = run_torchrun(WORKER, 4, args=[f"equivalence,skewed,empty,edp,load:{ckpt}", "--ep-sizes", "4,2"],
                          timeout=300).check()
    _assert_ok(result, 4, ["equivalence", "equivalence-combine", "skewed", "empty", "edp"], [4, 2])
    assert "rank=1 ep=2 scenario=edp ok (edp ranks [1, 3])" in result.log(1)
    for rank in range(4):
        assert f"rank={rank} loaded EP=2 checkpoint at EP=4 ok" in result.log(rank)
        assert f"rank={rank} loaded EP=2 checkpoint at EP=1 ok" in result.log(rank)


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.parametrize("transport,expected", [("peer", "peer"), ("all_to_all", "all_to_all")])
def test_nccl_bf16_ep2_equals_ep1(tmp_path, transport, expected):
    """Both GPU transports of the EP=2 layer (peer memory forced, then the NCCL all-to-all)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    scenarios = ["equivalence", "sigmoid", "skewed", "one_expert", "empty"]
    result = run_torchrun(WORKER, 2, args=[",".join(scenarios) + f",save:{tmp_path},load:{tmp_path}", "--backend", "nccl"],
                          env={"TE_DIST_EP_TRANSPORT": transport}, timeout=400).check()
    _assert_ok(result, 2, scenarios + ["equivalence-combine"], [2])
    for rank in range(2):
        assert f"rank={rank} loaded EP=2 checkpoint at EP=1 ok" in result.log(rank)
        ep2_lines = [line for line in result.log(rank).splitlines() if f"rank={rank} ep=2 scenario=" in line]
        assert ep2_lines and all(line.endswith(f"transport={expected}") for line in ep2_lines), ep2_lines
