"""Tile-configuration choice per problem shape (kept apart from launch code; read it as a table).

Configs compiled from grouped_gemm.cu (TE_GG_CONFIG):

| id | schedule    | tile (M x N x K) | cluster | meant for |
|----|-------------|------------------|---------|-----------|
| 0  | cooperative | 128 x 256 x 64   | 2x1x1   | large M per expert: 2 consumer warpgroups share one big tile, B multicast along M |
| 1  | ping-pong   | 64 x 128 x 64    | 1x1x1   | decode (a few rows per expert): smallest wgmma M, least padding |
| 2  | ping-pong   | 128 x 128 x 64   | 1x2x1   | small M (64..256 rows per expert): one M tile per expert, so no idle cluster half; A multicast along N |
| 3  | cooperative | 256 x 128 x 64   | 1x2x1   | large M, wide N-multicast alternative to 0 |

``CANDIDATES`` (ids 4-7) are further tiles for sweeps; they are not built by default.

Rule: see ``RULES`` (first match wins; keyed on the average rows per expert, which is the
GEMM's M for fwd/dgrad and its K for wgrad). Thresholds come from the H200 sweep in docs/kernels.md
(benchmarks/grouped_gemm.py times every config per shape and prints the winner).
"""

from __future__ import annotations

__all__ = ["CONFIGS", "CANDIDATES", "TILES", "RULES", "choose_config"]

# id: (schedule, tile M, tile N, tile K, (cluster M, cluster N)); build.py turns these into macros.
CONFIGS = {
    0: ("cooperative", 128, 256, 64, (2, 1)),
    1: ("pingpong", 64, 128, 64, (1, 1)),
    2: ("pingpong", 128, 128, 64, (1, 2)),
    3: ("cooperative", 256, 128, 64, (1, 2)),
}
# Candidates for the small-M (weight-streaming) shapes, built only when a sweep asks for them
# (``benchmarks/grouped_gemm.py --candidates``); a candidate that wins moves into CONFIGS and RULES.
CANDIDATES = {
    4: ("pingpong", 128, 128, 64, (1, 1)),
    5: ("cooperative", 128, 128, 128, (1, 1)),
    6: ("pingpong", 128, 128, 128, (1, 1)),
    7: ("cooperative", 128, 128, 64, (1, 2)),
}
TILES = {**CONFIGS, **CANDIDATES}

# (direction or "*", max average rows per expert (inclusive) or None for any, config).
# From the H200 sweep of 2026-11-29 (docs/kernels.md; run-to-run spread ~3%):
RULES = (
    ("wgrad", 512, 3),    # wgrad's GEMM-K is the rows per expert: short K loops favour coop 256x128 (qwen3, small-M, decode)
    ("wgrad", 2048, 2),   # DeepSeek-V3 EP8 (1024 rows per expert): ping-pong 128x128 was best
    ("wgrad", None, 3),   # Mixtral (4096 rows per expert)
    ("*", 32, 1),         # decode: 64-row tiles waste least
    ("*", 128, 2),        # fine-grained small-M: one 128-row tile per expert, no idle cluster half
    ("*", None, 0),       # large M: cooperative 128x256, cluster 2x1
)


def choose_config(direction: str, num_rows: int, n: int, k: int, num_groups: int, sm_count: int = 132) -> int:
    """Config id for one call. ``n``/``k`` are the user-level out/in features (unused by the
    current table, kept in the signature so shape-dependent rules need no call-site change)."""
    m_avg = num_rows / max(num_groups, 1)
    for rule_direction, max_m, config in RULES:
        if rule_direction not in ("*", direction):
            continue
        if max_m is None or m_avg <= max_m:
            return config
    raise AssertionError("RULES must end with a catch-all row")
