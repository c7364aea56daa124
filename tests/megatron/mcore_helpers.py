"""Helpers shared by the Megatron tests and their torchrun workers.

CPU workarounds (tests only; the library applies none of them), where Megatron-Core assumes CUDA:
  1. ``torch.cuda.current_device`` answers the CPU device: Megatron's TopKRouter moves its weight to
     ``torch.cuda.current_device()`` on its first forward, DDP allocates its buffers there.
  2. ``torch.cuda.synchronize`` does nothing (torch_dist checkpoint save), and the CUDA RNG tracker's
     ``fork`` is a no-op (attention dropout).
With ``training=True`` (Megatron's DDP, optimizers and schedules), also:
  3. ``device="cuda"`` in factory calls means the CPU (:class:`CudaMeansCpu`): the schedule counts
     tokens in ``torch.zeros([], device="cuda")``.
  4. ``Tensor.type()`` names a CPU tensor as its CUDA type: Megatron's optimizers accept parameters by
     that name only (``'torch.cuda.FloatTensor'`` ...); nothing else in them needs CUDA.
  5. CUDA streams and events are no-ops (:func:`cpu_streams`): the alltoall token dispatcher copies its
     split sizes to the host on a side stream; ``Tensor.cuda()`` returns the tensor (the distributed
     optimizer gathers its state for a checkpoint through CUDA tensors).
  6. The alltoall dispatcher turns its split sizes into host numbers only when they live on a GPU
     (``maybe_move_tensor_to_cpu(as_numpy=True)``); the CPU ones are turned too (gloo takes no tensor).
All are applied only when no GPU is present, and undone by ``undo_cpu_workarounds``. (megatron-core
0.16's missing ``te_general_gemm`` is te_dist.megatron's to fix: see its ``_compat``.)
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch.nn.functional as F

__all__ = [
    "apply_cpu_workarounds", "undo_cpu_workarounds", "init_megatron", "destroy_megatron", "make_config",
    "build_moe_layer", "copy_experts_weights", "copy_moe_layer", "free_port", "device", "CudaMeansCpu",
    "cpu_streams",
]

_SAVED = {}


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")


class CudaMeansCpu(torch.overrides.TorchFunctionMode):
    """``device="cuda"`` in factory calls and ``.to("cuda")`` mean the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class _CpuEvent:
    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass


class _CpuStream:
    """The CPU runs in order: waits and events are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _CpuEvent()

    def synchronize(self):
        pass


_CPU_STREAM = _CpuStream()
_STREAM_NAMES = ("Stream", "current_stream", "stream")


def cpu_streams() -> dict:
    """Make ``torch.cuda``'s streams no-ops; returns what it replaced."""
    saved = {name: getattr(torch.cuda, name) for name in _STREAM_NAMES}
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda *args, **kwargs: _CPU_STREAM
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    return saved


def _cuda_type_name(original):
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is not None or kwargs:
            return original(self, dtype, non_blocking, **kwargs)
        name = original(self)  # may come back through a TorchFunctionMode as this function: name once
        return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)

    return type_


def _split_sizes_to_host(original):
    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return to_host


def apply_cpu_workarounds(training: bool = False) -> None:
    if torch.cuda.is_available() or _SAVED:
        return
    _SAVED["current_device"] = torch.cuda.current_device
    _SAVED["synchronize"] = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    _SAVED["tracker"] = tracker
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    if training:
        _SAVED["type"] = torch.Tensor.type
        torch.Tensor.type = _cuda_type_name(torch.Tensor.type)
        _SAVED["streams"] = cpu_streams()
        _SAVED["tensor_cuda"] = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        from megatron.core.transformer.moe import token_dispatcher

        _SAVED["to_host"] = token_dispatcher.maybe_move_tensor_to_cpu
        token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_to_host(token_dispatcher.maybe_move_tensor_to_cpu)
        _SAVED["mode"] = CudaMeansCpu()
        _SAVED["mode"].__enter__()


def undo_cpu_workarounds() -> None:
    if not _SAVED:
        return
    if "mode" in _SAVED:
        _SAVED.pop("mode").__exit__(None, None, None)
        torch.Tensor.type = _SAVED.pop("type")
        for name, value in _SAVED.pop("streams").items():
            setattr(torch.cuda, name, value)
        torch.Tensor.cuda = _SAVED.pop("tensor_cuda")
        from megatron.core.transformer.moe import token_dispatcher

        token_dispatcher.maybe_move_tensor_to_cpu = _SAVED.pop("to_host")
    torch.cuda.current_device = _SAVED.pop("current_device")
    torch.cuda.synchronize = _SAVED.pop("synchronize")
    del _SAVED.pop("tracker").fork  # back to the class method


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
    import te_dist.megatron.experts  # noqa: F401  (binds 0.16's missing te_general_gemm: SequentialMLP arms too)

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
