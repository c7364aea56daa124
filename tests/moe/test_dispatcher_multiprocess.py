"""The token dispatcher across real torchrun ranks (gloo), with closed-form stand-in experts."""

from pathlib import Path

import pytest

from harness import run_torchrun

WORKER = Path(__file__).parent / "workers" / "dispatch_worker.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc,num_experts", [(1, 4), (2, 8), (4, 8), (4, 4)])
def test_dispatch_combine_forward_backward(nproc, num_experts):
    result = run_torchrun(WORKER, nproc, args=["random,skewed,empty", "--num-experts", num_experts], timeout=180).check()
    for rank in range(nproc):
        for scenario in ("random", "skewed", "empty"):
            assert f"rank={rank} scenario={scenario} ok transport={'local' if nproc == 1 else 'all_to_all'}" in result.log(rank)


@pytest.mark.multiprocess
def test_nan_routing_on_one_rank_raises_on_every_rank_without_hang():
    result = run_torchrun(WORKER, 2, args=["nan"], timeout=120).check()
    for rank in range(2):
        assert f"rank={rank} scenario=nan raised RoutingError" in result.log(rank)
        assert "EP rank(s) [1]" in result.log(rank)


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.parametrize("transport,env,expected", [
    ("peer", {}, "peer"),
    ("all_to_all", {}, "all_to_all"),
    ("peer", {"TE_DIST_EP_TRANSPORT": "all_to_all"}, "all_to_all"),  # the environment overrides the argument
])
def test_dispatch_combine_nccl(transport, env, expected):
    """Both GPU transports: rows through peer memory (forced: it raises where unavailable) and the
    NCCL all-to-all. Hidden 8 fp32 rows are 32 bytes, a multiple of the peer path's 16. "grow" makes
    the peer regions (2 MiB after the first scenarios) grow under rows already packed into them."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    result = run_torchrun(WORKER, 2, args=["random,skewed,empty,grow,nan", "--backend", "nccl", "--hidden", 8,
                                                 "--transport", transport], env=env, timeout=300).check()
    for rank in range(2):
        for scenario in ("random", "skewed", "empty", "grow"):
            assert f"rank={rank} scenario={scenario} ok transport={expected}" in result.log(rank)
        assert f"rank={rank} scenario=nan raised RoutingError" in result.log(rank)
