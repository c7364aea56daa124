"""Sizes of a ``te-dist train`` job worked out from its config alone: parameters, FLOPs per token, memory.

Why from the config (no model built, no torch): the CLI parent states what a job will need
before it starts any rank, and refuses a CPU job that cannot fit in the machine's memory, instead
of letting the kernel OOM-kill a rank minutes later. The worker uses the same FLOPs per token for
its MFU column.

Legend: V vocab, H hidden, F expert FFN, E experts (El = E / ep per rank), k top-k, L layers,
S sequence length, T tokens per rank per step, b bytes per element of ``model.dtype``.

Counts follow te_dist.train.model exactly (tests/cli/test_estimate.py builds the model and
compares). FLOPs per token are the usual training estimate (as torchtitan counts them):
``6 * active matmul parameters + 12 * L * H * S`` (forward + backward, attention scores counted
over the full sequence), where "active" means the weights one token's GEMMs read: attention,
router, its k experts and the LM head (the embedding is a lookup).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .config import ConfigError, JobConfig, ModelConfig, model_dtype

__all__ = ["ModelSize", "model_size", "flops_per_token", "fp8_flops_share", "speedup_ceiling", "speedup_needed", "MemoryEstimate", "memory_estimate", "available_memory",
           "check_fits", "peak_flops", "GiB"]

GiB = 1024**3
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ROUTER_BYTES = 4  # the router weight is kept in fp32 whatever the model dtype

# Resident memory of one CPU rank before any tensor of the model: the interpreter, torch, gloo and
# te_dist (peak RSS of the default tiny job: 0.33 GiB on one rank, rounded up for gloo peers).
CPU_RANK_BASE = int(0.45 * GiB)
# A CUDA context and the NCCL buffers a rank holds outside the caching allocator (typical, rounded up).
GPU_RANK_BASE = int(1.0 * GiB)
# Temporaries that live beside the saved activations at the backward's peak (gradients of the
# activations, the all-to-all buffers, the emulated recipes' dequantized copies): peak RSS over
# the counted tensors was 1.0-1.4 on CPU runs (docs/launching.md), so the estimate errs high.
_ACTIVATION_PEAK_FACTOR = 1.3


def _fc1_out(m: ModelConfig) -> int:
    return 2 * m.ffn_hidden_size if m.activation == "swiglu" else m.ffn_hidden_size


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of the model (elements), split by how they are placed on ranks."""

    dense: int  # replicated on every rank (embedding, attention, norms, head), router excluded
    router: int  # router weights (fp32), replicated
    expert: int  # every expert of every layer (sharded over EP)
    active: int  # matmul weights one token reads (FLOPs), embedding excluded

    @property
    def total(self) -> int:
        return self.dense + self.router + self.expert

    def per_rank(self, ep: int) -> int:
        return self.dense + self.router + self.expert // ep


def model_size(m: ModelConfig) -> ModelSize:
    V, H, F, E, L = m.vocab_size, m.hidden_size, m.ffn_hidden_size, m.num_experts, m.num_layers
    attn = 4 * H * H  # qkv (3H x H) and the output projection (H x H), no biases
    norms = 2 * H  # two RMSNorm weights per block
    one_expert = H * _fc1_out(m) + F * H + ((_fc1_out(m) + H) if m.expert_bias else 0)
    dense = 2 * V * H + L * (attn + norms) + H  # embedding, blocks, final norm, head
    active = L * (attn + E * H + m.top_k * (H * _fc1_out(m) + F * H)) + V * H
    return ModelSize(dense=dense, router=L * E * H, expert=L * E * one_expert, active=active)


def flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token."""
    return 6 * model_size(m).active + 12 * m.num_layers * m.hidden_size * seq_len


def fp8_flops_share(m: ModelConfig, seq_len: int) -> float:
    """The part of a token's training FLOPs in GEMMs an FP8 recipe quantizes, the part it can speed up:
    the expert MLPs, and with ``model.fp8_dense`` the attention projections and the LM head (the router
    and the attention scores stay in the model dtype)."""
    H, L = m.hidden_size, m.num_layers
    quantized = L * m.top_k * (H * _fc1_out(m) + m.ffn_hidden_size * H)
    if m.fp8_dense:
        quantized += L * 4 * H * H + m.vocab_size * H
    return 6 * quantized / flops_per_token(m, seq_len)


def speedup_ceiling(share: float, part_speedup: float) -> float:
    """Amdahl: the whole step's speed-up when a part holding ``share`` of its time runs
    ``part_speedup`` times faster and the rest does not change."""
    return 1.0 / ((1.0 - share) + share / part_speedup)


def speedup_needed(share: float, target: float) -> float:
    """The inverse: how much faster the part holding ``share`` must run for the whole step to speed up
    ``target`` times (inf where even an instant part falls short)."""
    rest = 1.0 / target - (1.0 - share)
    return share / rest if rest > 0 else float("inf")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs at its peak, by kind."""

    params: int
    grads: int
    optimizer: int
    activations: int
    runtime: int  # interpreter + torch (CPU) or CUDA context (GPU), not proportional to the model

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.runtime

    def describe(self) -> str:
        parts = (("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer),
                 ("activations", self.activations), ("runtime", self.runtime))
        return ", ".join(f"{name} {_size(v)}" for name, v in parts) + f" = {_size(self.total)}"


def _size(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / 1024**2:.1f} MiB"


def _activation_bytes(cfg: JobConfig, tokens: int, b: int) -> int:
    """Tensors saved for the backward of one rank's micro-batch (T tokens), at their peak (``b`` bytes per element)."""
    m = cfg.model
    H, k, T = m.hidden_size, m.top_k, tokens
    attention = 7 * T * H * b  # norm in/out, q, k, v, attention out, projection in
    routed = T * k * (3 * H + _fc1_out(m) + m.ffn_hidden_size) * b  # dispatch, fc1 out, act out, fc2 out, combine
    router = 3 * T * m.num_experts * 4  # logits, scores, their gradient (fp32)
    per_layer = attention + 3 * T * H * b + routed + router
    head = T * m.vocab_size * (b + 4 + 4)  # logits, their fp32 copy, log-softmax saved by the loss
    return int(_ACTIVATION_PEAK_FACTOR * (m.num_layers * per_layer + head + T * H * b))


def memory_estimate(cfg: JobConfig, world_size: int, *, device_type: str) -> MemoryEstimate:
    """Peak bytes per rank of ``cfg`` on ``world_size`` ranks; ``device_type`` 'cpu' or 'cuda'."""
    ep, per_rank_batch = cfg.layout(world_size)
    size, b = model_size(cfg.model), _DTYPE_BYTES[model_dtype(cfg.model.dtype, device_type)]
    params = (size.dense + size.expert // ep) * b + size.router * _ROUTER_BYTES
    # .grad, plus (with peers) the flat buffer each gradient all-reduce concatenates into
    grads = params * (2 if world_size > 1 else 1)
    optimizer = 2 * params  # AdamW exp_avg and exp_avg_sq, in the parameters' dtype
    activations = _activation_bytes(cfg, per_rank_batch // cfg.train.micro_batches * cfg.data.seq_len, b)
    runtime = CPU_RANK_BASE if device_type == "cpu" else GPU_RANK_BASE
    return MemoryEstimate(params, grads, optimizer, activations, runtime)


def available_memory() -> Optional[int]:
    """Bytes the kernel can give new processes now (``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(estimate: MemoryEstimate, ranks: int, available: Optional[int]) -> None:
    """Raise ConfigError when ``ranks`` ranks of ``estimate`` need more than ``available`` bytes."""
    need = ranks * estimate.total
    if available is None or need <= available:
        return
    raise ConfigError(
        f"this job needs about {_size(need)} of memory ({ranks} ranks x {_size(estimate.total)}: "
        f"{estimate.describe()}), but the machine has {_size(available)} available; use fewer ranks (--nproc), "
        f"a smaller model (--model.num_layers, --model.hidden_size, --model.vocab_size), a smaller batch "
        f"(--data.global_batch_size, --data.seq_len) or GPUs (--device cuda); --skip-memory-check launches anyway"
    )


# Dense bf16 tensor-core peak per GPU (FLOP/s), the reference of the MFU column; by device name.
_PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12), ("B200", 2250e12),
              ("B100", 1750e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12))


def peak_flops(device_name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s of a GPU named ``device_name`` (None when unknown, e.g. a CPU)."""
    for key, value in _PEAK_BF16:
        if key in device_name:
            return value
    return None
