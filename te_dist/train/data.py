"""Synthetic text with learnable structure: token sequences from a fixed random Markov chain.

Why this data: every token has only ``branching`` possible successors, so a model that learns
the chain drives the loss from ``ln(vocab)`` towards the chain's entropy rate; the run shows
real learning without a download. Why batches are a pure function of ``(seed, step)``: the
global batch of a step is the same whatever the number of ranks or the EP size, and a resumed
run sees exactly the batches an uninterrupted run would have seen (no loader state to save).

    global batch [B, S+1] of step s  --rank r takes rows [r*B/W, (r+1)*B/W)-->  inputs [b, S], targets [b, S]
"""

from __future__ import annotations

import math

import torch

__all__ = ["MarkovData", "step_generator", "rank_rows"]

# The held-out batches of the synthetic data come from their own stream, never from a training step's.
_VAL_STREAM = 7_919


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator that draws step ``step``'s global batch: a pure function of (seed, step)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def rank_rows(global_batch_size: int, rank: int, world_size: int) -> slice:
    """The rows of a global batch that ``rank`` of ``world_size`` trains on: a contiguous equal share,
    so the ranks together always cover the same global batch whatever their number."""
    if global_batch_size % world_size:
        raise ValueError(f"{global_batch_size=} is not divisible by {world_size=}")
    per_rank = global_batch_size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


class MarkovData:
    """Batches of a random first-order Markov chain over ``vocab_size`` tokens.

    The chain: a hidden walk ``z[t+1] = (z[t] + step[c_t]) mod V`` where the choice ``c_t`` takes
    one of ``branching`` distinct offsets with fixed, uneven probabilities, seen through a random
    permutation (``token = perm[z]``). Every token thus has ``branching`` successors that look
    random, the entropy rate is exactly that of the choice, and a whole batch is sampled with one
    cumulative sum (no loop over positions: long sequences on fast GPUs must not wait for data).
    """

    def __init__(self, vocab_size: int, seq_len: int, global_batch_size: int, *, branching: int, seed: int):
        if not 1 <= branching < vocab_size:
            raise ValueError(f"{branching=} must be in [1, {vocab_size=})")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.perm_V = torch.randperm(vocab_size, generator=gen)
        self.offsets_C = torch.randperm(vocab_size - 1, generator=gen)[:branching] + 1  # distinct, non-zero
        weights_C = torch.rand(branching, generator=gen, dtype=torch.float64) + 0.5
        self.probs_C = weights_C / weights_C.sum()
        self._cdf_C = self.probs_C.cumsum(0)
        self._cdf_C[-1] = 1.0  # guard against rounding below 1
        inverse_V = torch.empty_like(self.perm_V)
        inverse_V[self.perm_V] = torch.arange(vocab_size)
        # successors_VC[y] = the tokens that may follow token y
        self.successors_VC = self.perm_V[(inverse_V[:, None] + self.offsets_C[None, :]) % vocab_size]

    has_val = False  # every batch is new: the training loss is already a held-out loss (train.eval_every)

    def describe(self) -> str:
        return (f"Markov chain, uniform loss {self.uniform_loss():.4f}, best possible loss (entropy rate) "
                f"{self.entropy_rate():.4f}")

    def reference_losses(self) -> dict:
        """Losses the summary compares with: a model that knows nothing, and the best possible one."""
        return {"uniform": self.uniform_loss(), "best possible": self.entropy_rate()}

    def entropy_rate(self) -> float:
        """The best achievable mean loss (nats/token) for a model that knows the chain."""
        p = self.probs_C
        return float(-(p * p.log()).sum())

    def uniform_loss(self) -> float:
        return math.log(self.vocab_size)

    def global_batch(self, step: int) -> torch.Tensor:
        """Token ids [B, S+1] (int64) of training step ``step`` (1-based), identical on every rank."""
        gen = step_generator(self.seed, step)
        B, S = self.global_batch_size, self.seq_len
        start_B = torch.randint(self.vocab_size, (B, 1), generator=gen)
        u_BS = torch.rand(B, S, generator=gen, dtype=torch.float64)
        choice_BS = torch.searchsorted(self._cdf_C, u_BS, right=True).clamp_(max=len(self.offsets_C) - 1)
        walk_BS = torch.cat([start_B, start_B + self.offsets_C[choice_BS].cumsum(1)], dim=1) % self.vocab_size
        return self.perm_V[walk_BS]

    def local_batch(self, step: int, rank: int, world_size: int) -> tuple:
        """(inputs [b, S], targets [b, S]) for ``rank``: its contiguous share of the global batch."""
        rows = self.global_batch(step)[rank_rows(self.global_batch_size, rank, world_size)]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def val_batch(self, index: int, rank: int, world_size: int) -> tuple:
        """Held-out batch ``index`` (0-based), from a stream no training step draws."""
        rows = self.global_batch(-_VAL_STREAM - index)[rank_rows(self.global_batch_size, rank, world_size)]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
