"""A Megatron-Core GPT MoE training run with te_dist's experts, end to end: the user's recipe.

    torchrun --nproc-per-node 2 launchers/megatron_gpt_moe.py --recipe block --steps 5 --micro-batches 4

What a Megatron-Core user writes, with te_dist's parts marked (docs/megatron.md walks through it):

    config = TransformerConfig(...)                      # MoE layers by moe_layer_freq, dense ones between
    config.fp8, config.fp8_recipe = "e4m3", "blockwise"  # te_dist: the experts read these fields (set after
                                                         #   construction: without TransformerEngine the
                                                         #   config refuses fp8 on MoE models)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    spec = te_dist.megatron.with_te_dist_experts(spec)  # te_dist: the only model change
    model = DistributedDataParallel(config, ddp_config, GPTModel(config, spec, ...))
    optimizer = get_megatron_optimizer(OptimizerConfig(use_distributed_optimizer=True, ...), [model])
    get_forward_backward_func()(..., num_microbatches=N); optimizer.step()
    dist_checkpointing.save({"model": ..., "optimizer": optimizer.sharded_state_dict(...)}, dir)

Megatron's schedule marks the first micro-batch of every step (``set_is_first_microbatch``, because
the config names an FP8 recipe): the experts cast their FP8 weight copy there, after the distributed
optimizer's new weights have landed, and reuse it for the other micro-batches.

Everything here is Megatron-Core's public API except the marked lines. ``experts="sequential"``
builds the same model with Megatron's own SequentialMLP (the reference the tests compare with).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional

import torch

from ..recipe import RECIPE_NAMES

__all__ = ["RunSettings", "MEGATRON_FIELDS", "build_model", "wrap_for_training", "train_step",
           "synthetic_tokens", "save_checkpoint", "load_checkpoint", "main"]

# te_dist recipe name -> the Megatron config fields that select it (te_dist.megatron.recipe_config maps back)
MEGATRON_FIELDS = {
    "none": {},
    "delayed": {"fp8": "hybrid", "fp8_recipe": "delayed"},
    "current": {"fp8": "hybrid", "fp8_recipe": "tensorwise"},
    "block": {"fp8": "e4m3", "fp8_recipe": "blockwise"},
    "mxfp8": {"fp8": "e4m3", "fp8_recipe": "mxfp8"},
    "nvfp4": {"fp4": "e2m1", "fp4_recipe": "nvfp4"},
}
EXPERTS = ("te_dist", "sequential")
# The distributed optimizer's checkpoint formats in megatron-core >= 0.16 (docs/megatron.md)
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings:
    """One run's model, parallel layout and training settings (validated at construction)."""

    experts: str = "te_dist"
    recipe: str = "none"
    ep_size: int = 1
    distributed_optimizer: bool = True
    overlap: bool = False  # overlap_grad_reduce, and overlap_param_gather with the distributed optimizer
    num_layers: int = 2
    moe_layer_freq: tuple = (0, 1)  # layer i is MoE where 1: a dense layer, then an MoE layer
    hidden_size: int = 16
    ffn_hidden_size: int = 32
    moe_ffn_hidden_size: int = 16
    num_experts: int = 4
    top_k: int = 2
    vocab_size: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2
    num_microbatches: int = 4
    lr: float = 1e-2
    bf16: bool = False
    seed: int = 1234

    def __post_init__(self):
        if self.experts not in EXPERTS:
            raise ValueError(f"experts={self.experts!r}; expected one of {EXPERTS}")
        if self.recipe not in RECIPE_NAMES:
            raise ValueError(f"recipe={self.recipe!r}; expected one of {RECIPE_NAMES}")
        if self.experts == "sequential" and self.recipe != "none":
            raise ValueError(f"recipe={self.recipe!r} needs experts='te_dist' (SequentialMLP runs no FP8 "
                             "without TransformerEngine)")
        if len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq={self.moe_layer_freq} must have num_layers={self.num_layers} entries")
        for name in ("ep_size", "num_layers", "num_experts", "top_k", "micro_batch_size", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}")


def megatron_config(settings: RunSettings):
    """The TransformerConfig of the run, with the recipe's fp8/fp4 fields."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if settings.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=settings.num_layers, hidden_size=settings.hidden_size, num_attention_heads=2,
        ffn_hidden_size=settings.ffn_hidden_size, moe_ffn_hidden_size=settings.moe_ffn_hidden_size,
        num_moe_experts=settings.num_experts, moe_router_topk=settings.top_k,
        moe_layer_freq=list(settings.moe_layer_freq), expert_model_parallel_size=settings.ep_size,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        bias_activation_fusion=False, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32", hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=settings.bf16, pipeline_dtype=dtype,
        use_cpu_initialization=True,  # one RNG stream for every expert module: te_dist and SequentialMLP start equal
    )
    for field, value in MEGATRON_FIELDS[settings.recipe].items():  # te_dist: the experts' recipe
        setattr(config, field, value)
    return config


def build_model(settings: RunSettings, config):
    """GPTModel with te_dist's experts in its MoE layers (or Megatron's SequentialMLP)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module

    from . import with_te_dist_experts  # also gives megatron-core 0.16's router its te_general_gemm

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    if settings.experts == "te_dist":
        spec = with_te_dist_experts(spec)  # te_dist: recipe=None reads the config's fp8/fp4 fields
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=settings.vocab_size,
                     max_sequence_length=settings.seq_length)
    if torch.cuda.is_available():
        model = model.cuda()
    return Float16Module(config, model) if settings.bf16 else model


def wrap_for_training(model, config, settings: RunSettings):
    """Megatron's DDP and optimizer, and the config hooks its schedule calls; (ddp_model, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    overlap_param_gather = settings.overlap and settings.distributed_optimizer
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=settings.distributed_optimizer,
        overlap_grad_reduce=settings.overlap, overlap_param_gather=overlap_param_gather,
        bucket_size=2048,  # several buckets even for a tiny model: the overlapped paths have work to do
    )
    ddp_model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=settings.lr, bf16=settings.bf16, clip_grad=1.0,
                        use_distributed_optimizer=settings.distributed_optimizer),
        [ddp_model],
    )
    config.finalize_model_grads_func = finalize_model_grads
    if settings.overlap:
        config.no_sync_func = ddp_model.no_sync
        config.grad_sync_func = ddp_model.start_grad_sync
    if overlap_param_gather:
        config.param_sync_func = ddp_model.start_param_sync
    return ddp_model, optimizer


def synthetic_tokens(settings: RunSettings, step: int, rank: int) -> list:
    """Token batches [micro_batch_size, seq_length] of one step on one data-parallel rank: the same for
    every run of the same settings, so two runs (te_dist / SequentialMLP, before / after a resume) compare."""
    generator = torch.Generator().manual_seed(settings.seed + 1000 * step + rank)
    shape = (settings.num_microbatches, settings.micro_batch_size, settings.seq_length)
    return list(torch.randint(0, settings.vocab_size, shape, generator=generator).unbind(0))


def train_step(ddp_model, optimizer, batches: list, settings: RunSettings) -> list:
    """One optimizer step over ``batches`` (one per micro-batch) with Megatron's schedule; the losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(ddp_model.parameters()).device
    seq = settings.seq_length
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(settings.micro_batch_size, -1)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator).to(device)
        labels = torch.roll(tokens, -1, dims=1)
        per_token = model(tokens, positions, mask, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}

        return per_token, loss_func

    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp_model],
        num_microbatches=len(batches), seq_length=seq, micro_batch_size=settings.micro_batch_size,
    )
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("the optimizer step was skipped (non-finite gradients)")
    return [float(out["lm loss"]) for out in outputs]


def _sharded_state(ddp_model, optimizer, sharding_type: str, is_loading: bool) -> dict:
    # (Megatron also knows "fully_sharded_model_space", which no model can save since 0.16: docs/megatron.md)
    if sharding_type not in SHARDING_TYPES + ("fully_sharded_model_space",):
        raise ValueError(f"sharding_type={sharding_type!r}; expected one of {SHARDING_TYPES}")
    metadata = {"distrib_optim_sharding_type": sharding_type}
    model_state = ddp_model.module.sharded_state_dict()
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)}


def save_checkpoint(ddp_model, optimizer, directory: str, *, sharding_type: str = "fully_reshardable") -> None:
    """Model and optimizer state as one Megatron distributed checkpoint (torch_dist format)."""
    from megatron.core import dist_checkpointing

    state = _sharded_state(ddp_model, optimizer, sharding_type, is_loading=False)
    dist_checkpointing.save(state, directory, content_metadata={"distrib_optim_sharding_type": sharding_type})


def load_checkpoint(ddp_model, optimizer, directory: str, *, sharding_type: str = "fully_reshardable") -> None:
    """Restore a checkpoint of :func:`save_checkpoint` into a freshly built model and optimizer."""
    from megatron.core import dist_checkpointing

    # Without Apex or TransformerEngine, Megatron's distributed optimizer reads Adam's step count from
    # torch's per-parameter state, which a fresh optimizer lacks (an AssertionError in its state_dict):
    # one zero-gradient step creates it. The load then replaces every value it set.
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()
    state = dist_checkpointing.load(_sharded_state(ddp_model, optimizer, sharding_type, is_loading=True),
                                    directory)
    ddp_model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    _restore_torch_adam_steps(optimizer)


def _restore_torch_adam_steps(optimizer) -> None:
    """Give every parameter of a torch Adam its own step count again, that of its group.

    Why: without Apex or TransformerEngine Megatron keeps the step count in the checkpoint's param
    groups; its load leaves each parameter's own count at the fresh optimizer's value and shares one
    tensor between them (which Adam then advances once per parameter).
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            if "step" not in group:
                continue  # Apex / TransformerEngine optimizers keep their own count
            for param in group["params"]:
                state = inner.optimizer.state.get(param)
                if state and torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def _parse(argv: Optional[list]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron_gpt_moe.py", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="none", choices=RECIPE_NAMES)
    parser.add_argument("--experts", default="te_dist", choices=EXPERTS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=256)
    parser.add_argument("--no-distributed-optimizer", action="store_true")
    parser.add_argument("--overlap", action="store_true", help="overlap grad reduce and param all-gather")
    parser.add_argument("--save", help="directory: write a distributed checkpoint after the last step")
    parser.add_argument("--load", help="directory: resume from a checkpoint of --save before the first step")
    parser.add_argument("--ckpt-format", default="fully_reshardable", choices=SHARDING_TYPES)
    return parser.parse_args(argv)


def main(argv: Optional[list] = None) -> int:
    """torchrun entry: NCCL, one GPU per rank (Megatron-Core's DDP, optimizers and schedules assume CUDA;
    the CPU run of these functions is tests/megatron/test_gpt_moe_example.py)."""
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("megatron_gpt_moe.py: needs a CUDA GPU per rank; the CPU/gloo run is "
              "tests/megatron/test_gpt_moe_example.py", file=sys.stderr)
        return 2
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    try:
        settings = RunSettings(
            experts=args.experts, recipe=args.recipe, ep_size=args.ep_size,
            distributed_optimizer=not args.no_distributed_optimizer, overlap=args.overlap,
            hidden_size=args.hidden_size, ffn_hidden_size=2 * args.moe_ffn_hidden_size,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size, num_microbatches=args.micro_batches, bf16=True,
        )
    except ValueError as err:
        print(f"megatron_gpt_moe.py: {err}", file=sys.stderr)
        return 2
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    try:
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=settings.ep_size)
        torch.manual_seed(settings.seed)
        model_parallel_cuda_manual_seed(settings.seed)
        config = megatron_config(settings)
        ddp_model, optimizer = wrap_for_training(build_model(settings, config), config, settings)
        if args.load:
            load_checkpoint(ddp_model, optimizer, args.load, sharding_type=args.ckpt_format)
        rank = parallel_state.get_data_parallel_rank()
        for step in range(args.steps):
            losses = train_step(ddp_model, optimizer, synthetic_tokens(settings, step, rank), settings)
            if dist.get_rank() == 0:
                print(f"step {step}: loss {sum(losses) / len(losses):.6f} (micro-batches {losses})", flush=True)
        if args.save:
            save_checkpoint(ddp_model, optimizer, args.save, sharding_type=args.ckpt_format)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0
