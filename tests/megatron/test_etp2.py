"""Two ranks, expert tensor-parallel size 2 (gloo on CPU): te_dist experts hold half of every expert's
ffn as Megatron's expert linears do, compute SequentialMLP's function, write SequentialMLP's checkpoint
(equal tensors for equal weights), reload at ETP=1, and initialise the same experts as at ETP=1."""

from pathlib import Path

import pytest
import torch

import mcore_helpers as H
from harness import run_torchrun

WORKER = Path(__file__).resolve().parent / "workers" / "etp2_moe.py"

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}

pytestmark = pytest.mark.multiprocess


def _load(layer, path):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(layer.sharded_state_dict(prefix="mlp."), str(path))
    missing, unexpected = layer.load_state_dict({k[len("mlp."):]: v for k, v in state.items()}, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected


@pytest.mark.parametrize("glu", [True, False], ids=["swiglu", "gelu"])
def test_etp2_matches_sequential_and_checkpoint_reshards_to_etp1(tmp_path, megatron_world1, glu):
    result = run_torchrun(WORKER, 2, args=(tmp_path, int(glu)), timeout=240, env=CPU_ONLY)
    result.check()
    for rank in (0, 1):
        assert f"rank {rank}: etp2 glu={int(glu)} OK" in result.log(rank)

    from megatron.core import dist_checkpointing

    # The same weights give the same checkpoint tensors as SequentialMLP's (keys, shapes, values).
    ours, seq = (dist_checkpointing.load_plain_tensors(str(tmp_path / name)) for name in ("ckpt_ours", "ckpt_seq"))
    assert sorted(ours) == sorted(seq)
    for key in ours:
        torch.testing.assert_close(ours[key], seq[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")

    # ETP=2 checkpoint -> ETP=1 layers (both kinds) in this process give the ETP=2 outputs token by token.
    config = H.make_config(gated_linear_unit=glu, add_bias_linear=True)
    for kind in ("sequential", "te_dist"):
        layer = H.build_moe_layer(config, kind)
        _load(layer, tmp_path / "ckpt_ours")
        # At ETP=2 each rank adds the (replicated) fc2 bias and the reduce-scatter sums the two ranks'
        # outputs, as Megatron's expert linears do: the ETP=1 layer computes that with twice the bias.
        with torch.no_grad():
            if kind == "sequential":
                for expert in layer.experts.local_experts:
                    expert.linear_fc2.bias.mul_(2)
            else:
                layer.experts.linear_fc2_bias.mul_(2)
        for rank in (0, 1):
            saved = torch.load(tmp_path / f"rank{rank}.pt")
            with torch.no_grad():
                y, _ = layer(saved["x"].to(H.device()))
            torch.testing.assert_close(y.cpu(), saved["y"], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{kind} rank{rank}: {m}")

    # Initialisation draws each expert's whole tensors: ETP=2 halves are the ETP=1 experts' halves.
    torch.manual_seed(0)
    ref = H.build_moe_layer(config, "te_dist")
    init = H.build_moe_layer(config, "te_dist")
    _load(init, tmp_path / "init")
    torch.testing.assert_close(init.experts.linear_fc1.weight, ref.experts.linear_fc1.weight, rtol=0, atol=0)
    torch.testing.assert_close(init.experts.linear_fc2.weight, ref.experts.linear_fc2.weight, rtol=0, atol=0)
