"""torchrun worker: Megatron MoELayer at expert tensor-parallel size 2 (TP=1, EP=1, ETP=2, two ranks).

Args: <out_dir> <glu: 0|1>. Each rank holds half of every expert's ffn. It checks that te_dist's experts
with SequentialMLP's local shards compute SequentialMLP's outputs and input gradients (the allgather
dispatcher gathers the tokens and reduce-scatters the outputs over the ETP group), and writes:
  <out_dir>/init        a checkpoint of te_dist's freshly initialised experts (seed 0)
  <out_dir>/ckpt_seq    SequentialMLP's checkpoint, <out_dir>/ckpt_ours ours with the same weights
  <out_dir>/rank<r>.pt  this rank's input and output (the parent reloads the checkpoints at ETP=1)
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/megatron: mcore_helpers

import mcore_helpers as H  # noqa: E402


def save(layer, path: Path) -> None:
    import psutil  # noqa: F401  Megatron's torch_dist writer needs it; without it the save hangs
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(layer.sharded_state_dict(prefix="mlp."), str(path))


def main(out_dir: Path, glu: bool) -> None:
    from megatron.core import parallel_state

    H.apply_cpu_workarounds()
    H.init_megatron(ep_size=1, etp_size=2)
    rank = dist.get_rank()
    config = H.make_config(gated_linear_unit=glu, add_bias_linear=True)
    torch.manual_seed(0)
    seq = H.build_moe_layer(config, "sequential")
    ours = H.build_moe_layer(config, "te_dist")
    assert (ours.experts.etp_size, ours.experts.etp_rank) == (2, parallel_state.get_expert_tensor_parallel_rank())
    ffn_local = config.moe_ffn_hidden_size // 2
    assert tuple(ours.experts.linear_fc2.weight.shape) == (4, config.hidden_size, ffn_local)
    save(ours, out_dir / "init")
    with torch.no_grad():  # non-zero biases, so the replicated fc2 bias is checked too
        for expert in seq.experts.local_experts:
            expert.linear_fc1.bias.normal_()
            expert.linear_fc2.bias.copy_(torch.linspace(-1, 1, config.hidden_size))
    H.copy_moe_layer(seq, ours)

    torch.manual_seed(100 + rank)  # different tokens per rank
    x = torch.randn(6, 2, config.hidden_size, dtype=config.params_dtype, device=H.device())
    dy = torch.randn_like(x)
    results = []
    for layer in (seq, ours):
        xi = x.clone().requires_grad_(True)
        y, _ = layer(xi)
        y.backward(dy)
        results.append((y.detach(), xi.grad))
    (y_ref, dx_ref), (y, dx) = results
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    for e, expert in enumerate(seq.experts.local_experts):
        torch.testing.assert_close(ours.experts.linear_fc1.weight.grad[e], expert.linear_fc1.weight.grad,
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.experts.linear_fc2.weight.grad[e], expert.linear_fc2.weight.grad,
                                   rtol=1e-4, atol=1e-5)

    save(seq, out_dir / "ckpt_seq")
    save(ours, out_dir / "ckpt_ours")
    torch.save({"x": x.cpu(), "y": y.cpu()}, out_dir / f"rank{rank}.pt")
    dist.barrier()
    print(f"rank {rank}: etp2 glu={int(glu)} OK", flush=True)
    H.destroy_megatron()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] == "1")
