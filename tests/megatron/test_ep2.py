"""Two ranks, EP=2 (gloo on CPU): te_dist experts in Megatron's MoELayer match SequentialMLP, and an
EP=2 checkpoint of our experts reloads at EP=1 into Megatron's SequentialMLP with the same outputs."""

from pathlib import Path

import pytest
import torch

import mcore_helpers as H
from harness import run_torchrun

WORKER = Path(__file__).resolve().parent / "workers" / "ep2_moe.py"

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}

pytestmark = pytest.mark.multiprocess


def test_ep2_allgather_matches_sequential_and_checkpoint_reshards_to_ep1(tmp_path, megatron_world1):
    # The workers run on CPU with gloo even on a GPU machine (the NCCL version is in test_gpu.py).
    result = run_torchrun(WORKER, 2, args=(tmp_path, "allgather"), timeout=240, env=CPU_ONLY)
    result.check()
    for rank in (0, 1):
        assert f"rank {rank}: ep2 allgather recipe=none OK" in result.log(rank)

    # EP=2 checkpoint (experts 0,1 on rank 0 and 2,3 on rank 1) -> EP=1 SequentialMLP in this process.
    from megatron.core import dist_checkpointing

    config = H.make_config(num_moe_experts=4)
    for kind in ("sequential", "te_dist"):
        layer = H.build_moe_layer(config, kind)
        state = dist_checkpointing.load(layer.sharded_state_dict(prefix="mlp."), str(tmp_path / "ckpt"))
        missing, unexpected = layer.load_state_dict({k[len("mlp."):]: v for k, v in state.items()}, strict=False)
        assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
        for rank in (0, 1):
            saved = torch.load(tmp_path / f"rank{rank}.pt")
            with torch.no_grad():
                # At EP=2 the allgather dispatcher routed over both ranks' tokens; each token's output
                # depends only on its own routing, so the EP=1 layer reproduces it token by token.
                y, _ = layer(saved["x"].to(H.device()))
            torch.testing.assert_close(y.cpu(), saved["y"], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{kind} rank{rank}: {m}")


def test_ep2_with_recipe_agrees_across_expert_parallel_ranks(tmp_path):
    result = run_torchrun(WORKER, 2, args=(tmp_path, "allgather", "current"), timeout=240, env=CPU_ONLY)
    result.check()
    for rank in (0, 1):
        assert f"rank {rank}: ep2 allgather recipe=current OK" in result.log(rank)
