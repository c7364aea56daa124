"""Tile-configuration choice per problem shape (kept apart from launch code; read it as a table).

Configs compiled from grouped_gemm.cu (TE_GG_CONFIG):

| id | name        | tile (M x N x K) | cluster | schedule    | good for |
|----|-------------|------------------|---------|-------------|----------|
| 0  | cooperative | 128 x 256 x 64   | 2x1x1   | cooperative | large M per expert: 2 consumer warpgroups share one big tile |
| 1  | pingpong    | 64 x 128 x 64    | 1x1x1   | ping-pong   | small M per expert (fine-grained MoE, decode): less padding waste, epilogue overlaps the next tile's MMA |

Rule (M = rows per expert on average for fwd/dgrad; for wgrad M is the out-feature count):

| condition | config |
|---|---|
| average M per expert <= ``SMALL_M`` | pingpong |
| cooperative tiles < ``WAVE_FRACTION`` x SMs (too few tiles to fill the GPU) | pingpong |
| otherwise | cooperative |

Thresholds were set from the H200 sweep in docs/kernels.md (benchmarks/grouped_gemm.py runs both
configs per shape and prints which one wins).
"""

from __future__ import annotations

__all__ = ["CONFIGS", "SMALL_M", "WAVE_FRACTION", "choose_config"]

CONFIGS = {0: ("cooperative", 128, 256), 1: ("pingpong", 64, 128)}
SMALL_M = 256
WAVE_FRACTION = 1.0


def _tiles(m: int, n: int, tile_m: int, tile_n: int) -> int:
    return -(-m // tile_m) * -(-n // tile_n)


def choose_config(direction: str, num_rows: int, n: int, k: int, num_groups: int, sm_count: int = 132) -> int:
    """Config id for one call. ``n``/``k`` are the user-level out/in features."""
    groups = max(num_groups, 1)
    if direction == "wgrad":
        m_per_group, n_gemm = n, k
        coop_tiles = groups * _tiles(m_per_group, n_gemm, 128, 256) if num_rows > 0 else 0
        return 1 if coop_tiles < WAVE_FRACTION * sm_count else 0
    n_gemm = n if direction == "fwd" else k
    m_avg = num_rows / groups
    if m_avg <= SMALL_M:
        return 1
    coop_tiles = groups * _tiles(int(m_avg), n_gemm, 128, 256)
    return 1 if coop_tiles < WAVE_FRACTION * sm_count else 0
