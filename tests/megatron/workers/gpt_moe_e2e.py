"""torchrun worker: te_dist.megatron.gpt_moe_example's training run, scenario by scenario.

Args: <out_dir> <scenario> [<scenario> ...]; each scenario prints one ``RESULT <name> <json>`` line per
rank (tests/harness.py ``scenario_results``), the parent test compares them.

    train/<experts>/<recipe>/<dist_opt 0|1>/<overlap 0|1>/<ep>   3 steps from SequentialMLP's initial
        weights: per-step losses, and after every step the FP8 copy check of each MoE layer (its output
        on a probe input against a freshly built GroupedExperts holding the same weights)
    ckpt/<save experts>/<load experts>/<sharding type>           2 steps, save, 2 more (the reference);
        a fresh model and optimizer of the load arm load the checkpoint and take the same 2 steps
"""

import dataclasses
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/megatron: mcore_helpers

import mcore_helpers as H  # noqa: E402

from te_dist.megatron import gpt_moe_example as ex  # noqa: E402

TRAIN_STEPS = 3
try:  # torch.distributed.checkpoint's error derives from BaseException only
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover
    CheckpointException = RuntimeError
_ERRORS = (Exception, CheckpointException)


def _settings(experts, recipe="none", dist_opt=True, overlap=False, ep=1, bf16=True):
    """bf16 with fp32 main weights as on a GPU (the CPU trains in fp32 when comparing the arms: there
    they agree to the last bit); 128-multiples for the FP8 block recipes' tiles."""
    return ex.RunSettings(experts=experts, recipe=recipe, distributed_optimizer=dist_opt, overlap=overlap,
                          ep_size=ep, bf16=bf16, hidden_size=128, moe_ffn_hidden_size=128, ffn_hidden_size=256)


def _build(settings, seed):
    """Model and optimizer of ``settings`` starting from SequentialMLP's initial weights for ``seed``
    (both arms start equal; te_dist's experts load SequentialMLP's per-expert keys)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=settings.ep_size)
    config = ex.megatron_config(settings)
    torch.manual_seed(seed)
    reference = ex.build_model(dataclasses.replace(settings, experts="sequential", recipe="none"), config)
    model = reference
    if settings.experts == "te_dist":
        model = ex.build_model(settings, config)
        model.load_state_dict(reference.state_dict(), strict=True)
    return ex.wrap_for_training(model, config, settings)


def _moe_experts(ddp_model):
    return [m for m in ddp_model.modules() if type(m).__name__ == "GroupedExperts"]


def _fp8_copy_check(experts_modules) -> list:
    """Per MoE layer: max |output - output of a fresh module with the same weights| on a probe input."""
    from te_dist.megatron import GroupedExperts

    diffs = []
    for experts in experts_modules:
        weight = experts.linear_fc1.weight
        generator = torch.Generator().manual_seed(7)
        counts = torch.tensor([5, 0, 3, 8][: experts.num_local_experts] + [4] * max(0, experts.num_local_experts - 4))
        x = torch.randn(int(counts.sum()), experts.config.hidden_size, generator=generator).to(weight)
        probs = torch.rand(x.shape[0], generator=generator).to(weight.device)
        with torch.no_grad():
            y = experts(x, counts, probs)[0]  # runs DDP's pre-hooks: an overlapped param gather lands first
            fresh = GroupedExperts(experts.num_local_experts, experts.config, recipe=None).to(weight.device)
            fresh.load_state_dict(experts.state_dict(), strict=True)
            diffs.append(float((fresh(x, counts, probs)[0].float() - y.float()).abs().max()))
    return diffs


def _flags(experts_modules) -> list:
    return [op.is_first_microbatch for e in experts_modules for op in (e.linear_fc1, e.linear_fc2)]


def _casts(experts_modules) -> int:
    return sum(op._weight_copy.casts for e in experts_modules for op in (e.linear_fc1, e.linear_fc2))


def train(experts, recipe, dist_opt, overlap, ep) -> dict:
    settings = _settings(experts, recipe, dist_opt == "1", overlap == "1", int(ep), bf16=torch.cuda.is_available())
    ddp_model, optimizer = _build(settings, seed=11)
    rank = dist.get_rank()  # EP ranks are data-parallel ranks of the dense layers here (TP = PP = 1)
    result = {"losses": [], "copy_diffs": [], "flags": [], "casts_per_step": []}
    moe = _moe_experts(ddp_model)
    for step in range(TRAIN_STEPS):
        casts = _casts(moe)
        result["losses"].append(ex.train_step(ddp_model, optimizer, ex.synthetic_tokens(settings, step, rank), settings))
        result["casts_per_step"].append(_casts(moe) - casts)
        result["flags"].append(_flags(moe))
        result["copy_diffs"].append(_fp8_copy_check(moe))
    return result


def _expert_layout(directory: Path) -> dict:
    """{checkpoint key: global shape} of the experts' tensors (model and optimizer state) as saved."""
    from megatron.core import dist_checkpointing

    return {key: list(tensor.global_shape) for key, tensor in dist_checkpointing.load_tensors_metadata(str(directory)).items()
            if ".experts." in key}


def _params(ddp_model) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().cpu() for p in ddp_model.module.parameters()])


def ckpt(save_experts, load_experts, sharding_type, out_dir: Path) -> dict:
    """``sharding_type`` "plain": Megatron's optimizer without the distributed optimizer."""
    directory = out_dir / f"ckpt_{save_experts}_{sharding_type}"
    rank = dist.get_rank()
    dist_opt = sharding_type != "plain"
    sharding_type = sharding_type if dist_opt else "fully_reshardable"  # (ignored without it)
    # fp32 params break megatron-core 0.16's distributed optimizer load (an in-place copy into a view of
    # a leaf): bf16 there, as on a GPU; fp32 on the CPU otherwise, where the two arms agree to the bit.
    bf16 = dist_opt or torch.cuda.is_available()
    settings = _settings(save_experts, dist_opt=dist_opt, bf16=bf16)
    ddp_model, optimizer = _build(settings, seed=11)
    for step in range(2):
        ex.train_step(ddp_model, optimizer, ex.synthetic_tokens(settings, step, rank), settings)
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    try:
        ex.save_checkpoint(ddp_model, optimizer, str(directory), sharding_type=sharding_type)
    except _ERRORS as err:  # (the parent test asserts which error)
        traceback.print_exc()
        return {"save_error": f"{type(err).__name__}: {err}"}
    layout = _expert_layout(directory) if rank == 0 else None
    reference = [ex.train_step(ddp_model, optimizer, ex.synthetic_tokens(settings, step, rank), settings)
                 for step in (2, 3)]
    reference_params = _params(ddp_model)

    load_settings = _settings(load_experts, dist_opt=dist_opt, bf16=bf16)
    ddp_model, optimizer = _build(load_settings, seed=23)  # other initial weights: the load must restore
    try:
        ex.load_checkpoint(ddp_model, optimizer, str(directory), sharding_type=sharding_type)
    except _ERRORS as err:
        traceback.print_exc()
        return {"load_error": f"{type(err).__name__}: {err}"[:2000], "reference": reference, "layout": layout}
    resumed = [ex.train_step(ddp_model, optimizer, ex.synthetic_tokens(load_settings, step, rank), load_settings)
               for step in (2, 3)]
    params = _params(ddp_model)
    return {"reference": reference, "resumed": resumed, "layout": layout,
            "params_max_diff": float((params - reference_params).abs().max()) if params.shape == reference_params.shape
            else None}


def main(out_dir: Path, scenarios: list) -> None:
    H.apply_cpu_workarounds(training=True)
    H.init_megatron()
    import te_dist

    print(f"te_dist from {te_dist.__file__}", flush=True)
    for scenario in scenarios:
        kind, *args = scenario.split("/")
        try:
            result = train(*args) if kind == "train" else ckpt(*args, out_dir)
        except Exception:  # noqa: BLE001  (a scenario's failure is reported, the others still run)
            result = {"error": traceback.format_exc()[-3000:]}
        print(f"RESULT {scenario} {json.dumps(result)}", flush=True)
        dist.barrier()
    H.destroy_megatron()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
