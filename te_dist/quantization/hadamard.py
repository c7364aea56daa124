"""Random Hadamard transform (RHT) for NVFP4 weight-gradient operands.

Why: outliers along the reduction dimension ruin 16-element FP4 blocks; multiplying each run of
16 elements by an orthogonal matrix ``T = diag(signs) @ H16 / 4`` spreads an outlier over the
block. Both wgrad operands are transformed along the reduction dimension, and since
``T @ T.T == I`` the product is unchanged: ``(a T)(T.T b) == a b``.

``H16`` is the Sylvester Hadamard matrix (``H1 = [1]``, ``H2n = [[Hn, Hn], [Hn, -Hn]]``). The
signs are drawn once from a CPU ``torch.Generator`` seeded with :data:`RHT_SEED` (so every rank
and device derives the same matrix): ``signs = 1 - 2 * torch.randint(0, 2, (16,), generator=g)``.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["RHT_SEED", "RHT_SIZE", "hadamard_matrix", "rht_matrix", "apply_rht", "invert_rht"]

RHT_SEED = 0x7E_D157  # "te dist"; documented so that other implementations can reproduce T
RHT_SIZE = 16


def hadamard_matrix(n: int = RHT_SIZE) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix of order n (a power of two), float32 on CPU."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n=}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@functools.lru_cache(maxsize=None)
def _rht_cpu(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    signs = 1.0 - 2.0 * torch.randint(0, 2, (RHT_SIZE,), generator=g).to(torch.float32)
    return signs[:, None] * hadamard_matrix(RHT_SIZE) / (RHT_SIZE**0.5)


_DEVICE_CACHE: dict = {}


def rht_matrix(device=None, seed: int = RHT_SEED) -> torch.Tensor:
    """The orthogonal 16x16 float32 matrix ``T`` on ``device`` (cached per device and seed)."""
    device = torch.device(device if device is not None else "cpu")
    key = (str(device), seed)
    t = _DEVICE_CACHE.get(key)
    if t is None:
        t = _rht_cpu(seed).to(device)
        _DEVICE_CACHE[key] = t
    return t


def apply_rht(x: torch.Tensor, seed: int = RHT_SEED) -> torch.Tensor:
    """x[..., K] (K a multiple of 16, float32) -> each run of 16 along the last dim times T."""
    k = x.shape[-1]
    if k % RHT_SIZE:
        raise ValueError(f"the Hadamard transform runs on 16-element blocks; last dim {k} is not a multiple of 16")
    t = rht_matrix(x.device, seed)
    return (x.reshape(*x.shape[:-1], k // RHT_SIZE, RHT_SIZE) @ t).reshape(x.shape)


def invert_rht(y: torch.Tensor, seed: int = RHT_SEED) -> torch.Tensor:
    """Inverse of :func:`apply_rht` (multiply by T.T, since T is orthogonal)."""
    k = y.shape[-1]
    if k % RHT_SIZE:
        raise ValueError(f"the Hadamard transform runs on 16-element blocks; last dim {k} is not a multiple of 16")
    t = rht_matrix(y.device, seed)
    return (y.reshape(*y.shape[:-1], k // RHT_SIZE, RHT_SIZE) @ t.T).reshape(y.shape)
