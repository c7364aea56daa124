"""The model ``te-dist train`` trains: a small decoder whose feed-forward layers are our MoELayer.

Legend: B sequences, S positions, H hidden, V vocabulary, T = B*S tokens.

    tokens [B, S] -> embed -> L x ( x + attn(norm(x)) ; x + moe(norm(x)) ) -> norm -> head -> logits [B, S, V]

Why every submodule is built under its own seed: the attention, norm and head weights must not
depend on how many random numbers the MoE layer drew (that depends on the EP size), so an EP=1
and an EP=2 model start from the same function, and a checkpoint moves between EP sizes.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, model_dtype
from .head_loss import lm_head_loss

__all__ = ["CausalSelfAttention", "MoEBlock", "MoETransformer", "build_model"]


@contextlib.contextmanager
def _seeded(seed: int):
    """Run module construction under ``seed`` without disturbing the caller's RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _dense(in_features: int, out_features: int, quantized: bool, *, dtype=None, device=None) -> nn.Module:
    """A bias-free linear layer: te_dist's BasicLinear where the recipe should quantize it
    (``model.fp8_dense``), else nn.Linear. Both hold ``weight`` [out, in] drawn alike (uniform in
    +-1/sqrt(in)), so a checkpoint and a seed mean the same weights either way."""
    if quantized:
        from ..ops import BasicLinear

        return BasicLinear(in_features, out_features, dtype=dtype, device=device)
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (the token-mixing layer); replicated on every rank."""

    def __init__(self, hidden_size: int, num_heads: int, *, dtype=None, device=None, quantized: bool = False):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"{hidden_size=} is not divisible by {num_heads=}")
        self.num_heads = num_heads
        self.qkv = _dense(hidden_size, 3 * hidden_size, quantized, dtype=dtype, device=device)
        self.proj = _dense(hidden_size, hidden_size, quantized, dtype=dtype, device=device)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, H = x_BSH.shape
        q, k, v = self.qkv(x_BSH).view(B, S, 3, self.num_heads, H // self.num_heads).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(B, S, H))


class MoEBlock(nn.Module):
    """Pre-norm block: causal attention, then the expert-parallel MoE feed-forward layer."""

    def __init__(self, cfg: ModelConfig, *, seed: int, ep_group=None, dtype=None, device=None, transport="auto"):
        super().__init__()
        from ..moe import MoELayer  # lazy: te_dist.train imports stay light for `te-dist --help`

        with _seeded(seed):
            self.attn_norm = nn.RMSNorm(cfg.hidden_size, dtype=dtype, device=device)
            self.attn = CausalSelfAttention(cfg.hidden_size, cfg.num_heads, dtype=dtype, device=device,
                                            quantized=cfg.fp8_dense)
            self.moe_norm = nn.RMSNorm(cfg.hidden_size, dtype=dtype, device=device)
        with _seeded(seed + 1):  # MoELayer's own contract: global expert e is EP-size invariant
            self.moe = MoELayer(
                cfg.hidden_size,
                cfg.ffn_hidden_size,
                cfg.num_experts,
                cfg.top_k,
                ep_group=ep_group,
                activation=cfg.activation,
                bias=cfg.expert_bias,
                aux_loss_coeff=cfg.aux_loss_coeff,
                dtype=dtype,
                device=device,
                transport=transport,
            )

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(self.attn_norm(x_BSH))
        B, S, H = x_BSH.shape
        y_TH = self.moe(self.moe_norm(x_BSH).reshape(B * S, H))
        return x_BSH + y_TH.view(B, S, H)


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, seed: int = 0, ep_group=None, device=None, transport: str = "auto"):
        super().__init__()
        dtype = getattr(torch, model_dtype(cfg.dtype, torch.device(device).type if device is not None else "cpu"))
        self.cfg = cfg
        with _seeded(seed):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
            nn.init.normal_(self.embed.weight, std=1.0)
        self.blocks = nn.ModuleList(
            MoEBlock(cfg, seed=seed + 100 * (i + 1), ep_group=ep_group, dtype=dtype, device=device, transport=transport)
            for i in range(cfg.num_layers)
        )
        with _seeded(seed + 1):
            self.norm = nn.RMSNorm(cfg.hidden_size, dtype=dtype, device=device)
            self.head = _dense(cfg.hidden_size, cfg.vocab_size, cfg.fp8_dense, dtype=dtype, device=device)

    def features(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """The final norm's output [B, S, H]: what the head reads."""
        x_BSH = self.embed(tokens_BS)
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return self.norm(x_BSH)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(tokens_BS))

    def loss(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
        """Mean next-token cross-entropy over this rank's tokens, in fp32 (``fused``: cross_entropy.py's kernels
        on CUDA, the same math without an fp32 copy of the logits; with an FP8 head, head and loss in one step
        where head_loss.py says so)."""
        return lm_head_loss(self.head, self.features(tokens_BS).flatten(0, 1), targets_BS.flatten(), fused=fused)


def build_model(cfg: ModelConfig, *, seed: int, ep_group=None, device: Optional[torch.device] = None,
                transport: str = "auto") -> MoETransformer:
    return MoETransformer(cfg, seed=seed, ep_group=ep_group, device=device, transport=transport)
