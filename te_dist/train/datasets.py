"""The data a ``te-dist train`` job reads: the synthetic Markov chain, or the file ``data.path``.

    data.path ──text (text_tokens.py)──> token file ──layout, one full pass (token_files.py)──> checks
              ──> TokenData: training windows in [0, num_train), validation windows in the tail

:func:`prepare_data` runs in the ``te-dist`` parent before any rank starts, so a bad file ends
the command with exit 2 and one line naming the file and the problem; every rank runs it again
and finds the tokens and their stats already in the cache.

Sampling: the global batch of step s is ``global_batch_size`` windows of ``seq_len + 1`` tokens
whose starts are drawn by ``step_generator(data.seed, s)`` over the training part; rank r of W
reads only its rows, ``rank_rows(B, r, W)``. The batch of a step is therefore a pure function of
(seed, s): the same after a resume, and the same set of windows on one rank or on two. The
validation windows are fixed (``train.eval_batches`` x B starts spread evenly over the tail), so
every evaluation scores the same tokens and val losses of different runs compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .config import JobConfig, data_kind
from .data import MarkovData, rank_rows, step_generator
from .run_dirs import DEFAULT_ROOT
from .text_tokens import tokenize_text
from .token_files import DataError, TokenFile, TokenStats, open_token_file, token_stats

__all__ = ["DataPlan", "TokenData", "prepare_data", "build_data", "cache_dir_of", "CACHE_DIR"]

CACHE_DIR = "token_cache"  # under the default output root unless data.cache_dir names another place


def cache_dir_of(cfg: JobConfig) -> Path:
    """``data.cache_dir``, else ``te_dist_out/token_cache``: beside the run directories, not in one,
    so every run on the same file (each in a directory of its own) reuses one tokenization."""
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(DEFAULT_ROOT) / CACHE_DIR


@dataclass(frozen=True)
class DataPlan:
    """A checked data file: where its tokens are, what they hold and how they split."""

    source: str  # data.path as given
    kind: str  # "text" or "tokens"
    tokens: TokenFile
    stats: TokenStats
    num_train: int
    cache_state: Optional[str] = None  # text: "built" or "reused" (the token file is in the cache)

    @property
    def num_val(self) -> int:
        return self.tokens.num_tokens - self.num_train

    def cache_line(self) -> Optional[str]:
        """What happened to the token cache (text only)."""
        if self.kind != "text":
            return None
        done = "tokenized into" if self.cache_state == "built" else "reusing its tokens in"
        return (f"[te-dist] data: {self.source} {done} {self.tokens.path} (byte-level, {self.tokens.num_tokens:,} "
                f"tokens; rebuilt when the text changes)")


def prepare_data(cfg: JobConfig) -> Optional[DataPlan]:
    """Tokenize (text), open and check ``data.path``; None for the synthetic data. Raises DataError."""
    d, t = cfg.data, cfg.train
    kind = data_kind(d.path)
    if kind is None:
        return None
    source = Path(d.path)
    cache_dir, cache_state = cache_dir_of(cfg), None
    if kind == "text":
        token_path, cache_state = tokenize_text(source, cache_dir)
        tokens = open_token_file(token_path, "uint16")
    else:
        tokens = open_token_file(source, d.token_dtype)
    stats = token_stats(tokens, cache_dir)
    if stats.min_token < 0:
        raise DataError(source, f"holds a negative token ({stats.min_token}); token ids must be >= 0")
    vocab = cfg.model.vocab_size
    if stats.max_token >= vocab:
        hint = " (byte-level tokens of text need 256)" if kind == "text" else ""
        raise DataError(source, f"its largest token is {stats.max_token}, but model.vocab_size is {vocab}{hint}; "
                                f"pass --model.vocab_size {stats.max_token + 1} or more")
    n, S, B = tokens.num_tokens, d.seq_len, d.global_batch_size
    num_train = n - math.floor(n * d.val_fraction)
    if num_train < B * S + 1:
        held = f" ({num_train:,} after the validation tail)" if num_train < n else ""
        raise DataError(source, f"too short: {n:,} tokens{held}, fewer than one batch needs (data.global_batch_size "
                                f"{B} x data.seq_len {S} + 1 = {B * S + 1:,}); use a longer file or a smaller batch")
    if n > num_train and n - num_train < S + 1:
        raise DataError(source, f"the validation tail (data.val_fraction {d.val_fraction} of {n:,} tokens = "
                                f"{n - num_train:,}) is shorter than one sequence (data.seq_len + 1 = {S + 1}); "
                                f"raise data.val_fraction, or set it to 0 for no validation")
    return DataPlan(str(source), kind, tokens, stats, num_train, cache_state)


class TokenData:
    """Batches of windows of a token file (module docstring); the same interface as MarkovData."""

    def __init__(self, plan: DataPlan, *, seq_len: int, global_batch_size: int, seed: int, eval_batches: int,
                 vocab_size: int):
        self.plan, self.seq_len, self.global_batch_size, self.seed = plan, seq_len, global_batch_size, seed
        self.vocab_size = vocab_size
        self.num_train = plan.num_train
        span = plan.num_val - (seq_len + 1)  # the last start that keeps a window inside the tail
        self._val_starts = (plan.num_train + np.linspace(0, span, eval_batches * global_batch_size).round()
                            .astype(np.int64)) if self.has_val else None

    @property
    def has_val(self) -> bool:
        return self.plan.num_val > 0

    def train_starts(self, step: int) -> np.ndarray:
        """Starts [B] of the windows of step ``step``'s global batch."""
        high = self.num_train - self.seq_len  # a window [start, start + S] ends inside the training part
        return torch.randint(high, (self.global_batch_size,), generator=step_generator(self.seed, step)).numpy()

    def _rows(self, starts: np.ndarray, rank: int, world_size: int) -> tuple:
        mine = starts[rank_rows(self.global_batch_size, rank, world_size)]
        rows = torch.from_numpy(self.plan.tokens.read_windows(mine, self.seq_len + 1))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def local_batch(self, step: int, rank: int, world_size: int) -> tuple:
        """(inputs [b, S], targets [b, S]) for ``rank``: its contiguous share of the global batch."""
        return self._rows(self.train_starts(step), rank, world_size)

    def val_batch(self, index: int, rank: int, world_size: int) -> tuple:
        """Validation batch ``index`` (0-based, < train.eval_batches): fixed windows of the tail."""
        B = self.global_batch_size
        return self._rows(self._val_starts[index * B : (index + 1) * B], rank, world_size)

    def reference_losses(self) -> dict:
        refs = {"uniform": math.log(self.vocab_size)}
        if self.plan.stats.unigram_entropy is not None:
            refs["unigram entropy"] = self.plan.stats.unigram_entropy
        return refs

    def describe(self) -> str:
        p, s = self.plan, self.plan.stats
        what = "byte-level tokens" if p.kind == "text" else f"{np.dtype(p.tokens.dtype).name} tokens"
        line = (f"{p.source} ({what}) | {p.tokens.num_tokens:,} tokens: {p.num_train:,} train, {p.num_val:,} "
                f"validation (the tail) | largest token {s.max_token} < vocab {self.vocab_size} | uniform loss "
                f"{math.log(self.vocab_size):.4f}")
        if s.unigram_entropy is not None:
            line += f", unigram entropy {s.unigram_entropy:.4f} (the loss of a model that knows only token frequencies)"
        return line


def build_data(cfg: JobConfig, plan: Optional[DataPlan] = None):
    """The job's data: MarkovData without ``data.path``, else TokenData over ``plan`` (prepared here if None)."""
    m, d = cfg.model, cfg.data
    if not d.path:
        return MarkovData(m.vocab_size, d.seq_len, d.global_batch_size, branching=d.branching, seed=d.seed)
    plan = plan if plan is not None else prepare_data(cfg)
    return TokenData(plan, seq_len=d.seq_len, global_batch_size=d.global_batch_size, seed=d.seed,
                     eval_batches=cfg.train.eval_batches, vocab_size=m.vocab_size)
