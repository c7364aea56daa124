"""torchrun worker: Megatron MoELayer at EP=2 with te_dist experts vs SequentialMLP.

Args: <out_dir> <dispatcher> [<recipe>]. Each rank checks its outputs and input gradients against
SequentialMLP with the same weights, saves a distributed checkpoint of the te_dist layer to
<out_dir>/ckpt and its input/output to <out_dir>/rank<r>.pt (the parent test reloads them at EP=1).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/megatron: mcore_helpers

import mcore_helpers as H  # noqa: E402


def main(out_dir: Path, dispatcher: str, recipe: str) -> None:
    H.apply_cpu_workarounds()
    H.init_megatron(ep_size=2)
    rank = dist.get_rank()
    torch.manual_seed(0)  # same router/expert init on every rank, as Megatron seeds
    config = H.make_config(num_moe_experts=4, moe_token_dispatcher_type=dispatcher)
    seq = H.build_moe_layer(config, "sequential")
    ours = H.build_moe_layer(config, "te_dist", recipe=recipe)
    assert ours.experts.num_local_experts == 2 and ours.experts.ep_rank == rank
    # Megatron's expert-parallel marking (DDP reduces these gradients over the expert-data-parallel group)
    assert {p.allreduce for p in ours.experts.parameters()} == {False}
    H.copy_moe_layer(seq, ours)

    device = next(ours.parameters()).device
    torch.manual_seed(100 + rank)  # different tokens per rank
    x = torch.randn(6, 2, config.hidden_size, device=device, dtype=config.params_dtype)
    dy = torch.randn_like(x)
    results = []
    for layer in (seq, ours):
        xi = x.clone().requires_grad_(True)
        y, bias = layer(xi)
        assert bias is None
        y.backward(dy)
        results.append((y.detach(), xi.grad))
    (y_ref, dx_ref), (y, dx) = results
    if recipe == "none":
        tol = dict(rtol=1e-5, atol=1e-6) if config.params_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(y, y_ref, **tol)
        torch.testing.assert_close(dx, dx_ref, **tol)
    else:  # quantized experts: same function within FP8 error, and the ranks agreed on the recipe
        assert not torch.equal(y, y_ref)
        torch.testing.assert_close(y, y_ref, rtol=0.2, atol=0.05)
        assert ours.experts._fuser.fusion_key[0] == str(ours.experts.recipe)
    for e in range(2):  # local expert weight gradients agree with Megatron's local experts
        expert = seq.experts.local_experts[e]
        if recipe == "none":
            torch.testing.assert_close(ours.experts.linear_fc1.weight.grad[e], expert.linear_fc1.weight.grad,
                                       rtol=1e-4, atol=1e-5)

    if recipe == "none":
        import psutil  # noqa: F401  Megatron's torch_dist writer needs it; without it the save hangs
        from megatron.core import dist_checkpointing

        ckpt = out_dir / "ckpt"
        if rank == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(ours.sharded_state_dict(prefix="mlp."), str(ckpt))
        torch.save({"x": x.cpu(), "y": y.cpu()}, out_dir / f"rank{rank}.pt")
    dist.barrier()
    print(f"rank {rank}: ep2 {dispatcher} recipe={recipe} OK", flush=True)
    H.destroy_megatron()
    if dist.is_initialized():  # megatron-core 0.19's teardown may already have destroyed it
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "none")
