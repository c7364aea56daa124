"""Synthetic text with learnable structure: token sequences from a fixed random Markov chain.

Why this data: every token has only ``branching`` likely successors, so a model that learns
the chain drives the loss from ``ln(vocab)`` towards the chain's entropy rate; the run shows
real learning without a download. Why batches are a pure function of ``(seed, step)``: the
global batch of a step is the same whatever the number of ranks or the EP size, and a resumed
run sees exactly the batches an uninterrupted run would have seen (no loader state to save).

    global batch [B, S+1] of step s  --rank r takes rows [r*B/W, (r+1)*B/W)-->  inputs [b, S], targets [b, S]
"""

from __future__ import annotations

import math

import torch

__all__ = ["MarkovData"]


class MarkovData:
    """Batches of a random first-order Markov chain over ``vocab_size`` tokens."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch_size: int, *, branching: int, seed: int):
        if branching > vocab_size:
            raise ValueError(f"{branching=} exceeds {vocab_size=}")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        # Each token: `branching` distinct successors with uneven weights (sparse: vocabularies
        # of LLM size must not need a V x V table).
        self.successors_VB = torch.stack(
            [torch.randperm(vocab_size, generator=gen)[:branching] for _ in range(vocab_size)]
        ) if vocab_size <= 4096 else torch.randint(vocab_size, (vocab_size, branching), generator=gen)
        weights_VB = torch.rand(vocab_size, branching, generator=gen, dtype=torch.float64) + 0.5
        self.probs_VB = weights_VB / weights_VB.sum(1, keepdim=True)
        self._cdf_VB = self.probs_VB.cumsum(1)
        self._cdf_VB[:, -1] = 1.0  # guard against rounding below 1

    def entropy_rate(self) -> float:
        """The best achievable mean loss (nats/token) for a model that knows the chain."""
        V = self.vocab_size
        probs_VV = torch.zeros(V, V, dtype=torch.float64) if V <= 4096 else None
        if probs_VV is None:  # large vocabularies: successors may repeat; the per-row bound is close enough
            p = self.probs_VB
            return float(-(p * p.log()).sum(1).mean())
        probs_VV.index_put_((torch.arange(V).repeat_interleave(self.probs_VB.shape[1]), self.successors_VB.flatten()),
                            self.probs_VB.flatten(), accumulate=True)
        stationary = torch.full((V,), 1.0 / V, dtype=torch.float64)
        for _ in range(500):
            stationary = stationary @ probs_VV
        row_entropy = -(torch.where(probs_VV > 0, probs_VV * probs_VV.log(), torch.zeros_like(probs_VV))).sum(1)
        return float((stationary * row_entropy).sum())

    def uniform_loss(self) -> float:
        return math.log(self.vocab_size)

    def global_batch(self, step: int) -> torch.Tensor:
        """Token ids [B, S+1] (int64) of training step ``step`` (1-based), identical on every rank."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        B, S = self.global_batch_size, self.seq_len
        tokens_BS = torch.empty(B, S + 1, dtype=torch.int64)
        tokens_BS[:, 0] = torch.randint(self.vocab_size, (B,), generator=gen)
        u_SB = torch.rand(S, B, generator=gen, dtype=torch.float64)
        for pos in range(S):
            cur_B = tokens_BS[:, pos]
            choice_B = torch.searchsorted(self._cdf_VB[cur_B], u_SB[pos].unsqueeze(1), right=True).squeeze(1)
            choice_B.clamp_(max=self.successors_VB.shape[1] - 1)
            tokens_BS[:, pos + 1] = self.successors_VB[cur_B, choice_B]
        return tokens_BS

    def local_batch(self, step: int, rank: int, world_size: int) -> tuple:
        """(inputs [b, S], targets [b, S]) for ``rank``: its contiguous share of the global batch."""
        if self.global_batch_size % world_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by {world_size=}")
        per_rank = self.global_batch_size // world_size
        rows = self.global_batch(step)[rank * per_rank : (rank + 1) * per_rank]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
