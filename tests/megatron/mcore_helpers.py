"""Helpers shared by the Megatron tests and their torchrun workers.

CPU workarounds (tests only; the library never applies them):
  1. ``torch.cuda.current_device`` answers the CPU device: Megatron's TopKRouter moves its weight to
     ``torch.cuda.current_device()`` on its first forward, which fails on a CPU-only machine.
  2. ``moe_utils.te_general_gemm = None``: megatron-core 0.16.1 references this TransformerEngine
     name in the router GEMM without defining it when TransformerEngine is absent (NameError).
Both are applied only when no GPU is present, and undone by ``undo_cpu_workarounds``.
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch.nn.functional as F

__all__ = [
    "apply_cpu_workarounds", "undo_cpu_workarounds", "init_megatron", "destroy_megatron", "make_config",
    "build_moe_layer", "copy_experts_weights", "copy_moe_layer", "free_port", "device",
]

_SAVED = {}


def apply_cpu_workarounds() -> None:
    if torch.cuda.is_available() or _SAVED:
        return
    import megatron.core.transformer.moe.moe_utils as moe_utils

    _SAVED["current_device"] = torch.cuda.current_device
    _SAVED["synchronize"] = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _SAVED["te_general_gemm"] = moe_utils.__dict__.get("te_general_gemm", _SAVED)
    torch.cuda.current_device = lambda: torch.device("cpu")
    if "te_general_gemm" not in moe_utils.__dict__:
        moe_utils.te_general_gemm = None
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    _SAVED["tracker"] = tracker
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()


def undo_cpu_workarounds() -> None:
    if not _SAVED:
        return
    import megatron.core.transformer.moe.moe_utils as moe_utils

    torch.cuda.current_device = _SAVED.pop("current_device")
    torch.cuda.synchronize = _SAVED.pop("synchronize")
    del _SAVED.pop("tracker").fork  # back to the class method
    previous = _SAVED.pop("te_general_gemm")
    if previous is _SAVED:
        moe_utils.__dict__.pop("te_general_gemm", None)
    else:
        moe_utils.te_general_gemm = previous


def device() -> torch.device:
    """Where Megatron puts modules in this process: the current GPU if there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_created_process_group = False


def init_megatron(ep_size: int = 1, etp_size: int = 1) -> None:
    """Initialise torch.distributed (if needed: world size 1, gloo/nccl) and Megatron's parallel_state
    (TP=PP=1, the given expert-parallel and expert tensor-parallel sizes)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import te_dist.distributed  # noqa: F401  (its exit hook: no SIGABRT after the last gloo collective)

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    global _created_process_group
    if not dist.is_initialized():
        _created_process_group = True  # ours to tear down, so later tests start without a group
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep_size,
                                             expert_tensor_parallel_size=etp_size)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)  # registers the RNG tracker states attention dropout forks


def destroy_megatron() -> None:
    global _created_process_group
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _created_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _created_process_group = False


def make_config(**overrides):
    """A tiny MoE TransformerConfig (fp32 on CPU, bf16 on GPU unless overridden)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=8,
        num_moe_experts=4, moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=not on_gpu,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_moe_layer(config, experts: str, **experts_options):
    """Megatron's MoELayer with ``experts="te_dist"`` (ours) or ``"sequential"`` (Megatron's SequentialMLP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import te_dist.megatron as tm

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts).submodules.mlp
    if experts == "te_dist":
        spec = tm.with_te_dist_experts(spec, **experts_options)
    elif experts != "sequential":
        raise ValueError(f"experts must be 'te_dist' or 'sequential', got {experts!r}")
    layer = spec(config=config)  # ModuleSpec (0.16) and functools.partial (0.19) are both callable
    return layer.to(device())


@torch.no_grad()
def copy_experts_weights(sequential, grouped) -> None:
    """SequentialMLP local expert e -> GroupedExperts slice e (the layout docs/megatron.md describes)."""
    for e, expert in enumerate(sequential.local_experts):
        grouped.linear_fc1.weight[e].copy_(expert.linear_fc1.weight)
        grouped.linear_fc2.weight[e].copy_(expert.linear_fc2.weight)
        if expert.linear_fc1.bias is not None:
            grouped.linear_fc1.bias[e].copy_(expert.linear_fc1.bias)
            grouped.linear_fc2_bias[e].copy_(expert.linear_fc2.bias)


@torch.no_grad()
def copy_moe_layer(sequential_layer, grouped_layer) -> None:
    grouped_layer.router.load_state_dict(sequential_layer.router.state_dict())
    copy_experts_weights(sequential_layer.experts, grouped_layer.experts)
