"""Tile-configuration choice per problem shape (kept apart from launch code; read it as a table).

Configs compiled from grouped_gemm.cu (TE_GG_CONFIG):

| id | schedule    | tile (M x N x K) | cluster | meant for |
|----|-------------|------------------|---------|-----------|
| 0  | cooperative | 128 x 256 x 64   | 2x1x1   | large M per expert: 2 consumer warpgroups share one big tile, B multicast along M |
| 1  | ping-pong   | 64 x 128 x 64    | 1x1x1   | decode (a few rows per expert): smallest wgmma M, least padding |
| 2  | ping-pong   | 128 x 128 x 64   | 1x2x1   | small M (64..256 rows per expert): one M tile per expert, so no idle cluster half; A multicast along N |
| 3  | cooperative | 256 x 128 x 64   | 1x2x1   | large M, wide N-multicast alternative to 0 |
| 10 | ping-pong   | 64 x 256 x 64    | 1x1x1   | ragged groups: 64-row padding, no cluster rounding, the widest wgmma (m64n256) per warpgroup |

``CANDIDATES`` (ids 4-9, 11-15) are further tiles for sweeps; they are not built by default. Ids
never change meaning (a candidate that wins moves into CONFIGS under its id), so sweep tables stay
comparable.

Rule: see ``RULES`` (first match wins; keyed on the average rows per expert, which is the
GEMM's M for fwd/dgrad and its K for wgrad, on the contraction length, and on whether the caller's
host group sizes are unequal). Thresholds come from the H200 sweeps in docs/kernels.md
(benchmarks/grouped_gemm.py times every config per shape and prints the winner).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

__all__ = ["CONFIGS", "CANDIDATES", "TILES", "Rule", "RULES", "choose_config"]

# id: (schedule, tile M, tile N, tile K, (cluster M, cluster N)); build.py turns these into macros.
CONFIGS = {
    0: ("cooperative", 128, 256, 64, (2, 1)),
    1: ("pingpong", 64, 128, 64, (1, 1)),
    2: ("pingpong", 128, 128, 64, (1, 2)),
    3: ("cooperative", 256, 128, 64, (1, 2)),
    10: ("pingpong", 64, 256, 64, (1, 1)),
}
# Candidates for sweeps (the small-M weight-streaming shape, ragged groups, short-K wgrad), built
# only when a sweep asks for them (``benchmarks/grouped_gemm.py --candidates``); a candidate that
# wins moves into CONFIGS and RULES.
CANDIDATES = {
    4: ("pingpong", 128, 128, 64, (1, 1)),
    5: ("cooperative", 128, 128, 128, (1, 1)),
    6: ("pingpong", 128, 128, 128, (1, 1)),
    7: ("cooperative", 128, 128, 64, (1, 2)),
    8: ("cooperative", 128, 256, 64, (1, 1)),  # config 0 without its cluster; ragged groups' second best
    9: ("cooperative", 128, 256, 64, (1, 2)),
    # Multicast variants: each was slower than the table's pick for the shape it targets (the sweep's
    # figures are in docs/kernels.md); kept so that the sweep can be rerun on other GPUs.
    11: ("pingpong", 128, 128, 64, (1, 4)),    # small-M: A multicast to 4 N tiles
    12: ("pingpong", 128, 128, 64, (2, 2)),    # short-K wgrad, both operands multicast
    13: ("cooperative", 256, 128, 64, (2, 2)),  # short-K wgrad, bigger tile
    14: ("pingpong", 64, 256, 64, (1, 2)),     # ragged groups: config 10 with A multicast
    15: ("pingpong", 64, 256, 64, (2, 1)),     # small-M, B multicast to its two 64-row tiles
}
TILES = {**CONFIGS, **CANDIDATES}


class Rule(NamedTuple):
    """One row of the table: it holds when the direction matches and the call's average rows per
    expert lie in (min_rows, max_rows], its contraction length (fwd: K, dgrad: N, wgrad: the
    rows) is at most max_k, each group's output has at least min_out elements (fwd: rows x N,
    dgrad: rows x K, wgrad: K x N) and, for a ``ragged`` row, the caller gave the group sizes on
    the host and they are not all equal. None = no bound."""

    direction: str  # "fwd", "dgrad", "wgrad" or "*"
    max_rows: Optional[int]
    config: int
    min_rows: int = 0
    max_k: Optional[int] = None
    min_out: int = 0
    ragged: bool = False


# Fitted to H200 sweeps of benchmarks/grouped_gemm.py (docs/kernels.md; run-to-run spread ~3%):
RULES = (
    # Short-K wgrad with large per-expert outputs (DeepSeek-like layer, 256 rows, 7168x4096 and
    # 2048x7168 per expert): ping-pong overlaps each tile's big epilogue with the other warpgroup's
    # 4-step K loop, +4-10% over coop 256x128.
    Rule("wgrad", 512, 2, min_rows=128, min_out=1 << 23),
    Rule("wgrad", 512, 3),    # wgrad's GEMM-K is the rows per expert: short K loops favour coop 256x128 (qwen3, small-M, decode)
    Rule("wgrad", 2048, 2),   # DeepSeek-V3 EP8 (1024 rows per expert): ping-pong 128x128 was best
    Rule("wgrad", None, 3),   # Mixtral (4096 rows per expert)
    # Forward and dgrad from here on. Ragged groups (unequal host sizes, as a router gives them) of
    # 65-768 rows on average: a grouped kernel pads every group to whole M tiles, 128 rows for the
    # tiles below and, with config 0's 2x1 cluster, an even count of them. Config 10 pads to 64 rows.
    # It beats the equal-split pick in 26 of 28 such GEMMs (+5% to +40%; 1% slower twice) and the
    # cluster-free 128x256 tile (candidate 8) in 27 of 28; at 1024 rows per expert it loses
    # (docs/kernels.md "Ragged group sizes").
    Rule("*", 768, 10, min_rows=64, ragged=True),
    Rule("*", 32, 1),         # decode: 64-row tiles waste least
    Rule("*", 128, 2),        # fine-grained small-M: one 128-row tile per expert, no idle cluster half
    # Contraction up to 4096 with up to 2048 rows: ping-pong 128x128 overlaps each tile's epilogue
    # with the other warpgroup's math. Forward: DeepSeek-V3 fc2 EP8 (1024 rows, K 2048) +1% to +11%,
    # the Mixtral-like layer's fc1 at EP=2 (1024 rows, K 4096) +5-7%; not at 256 rows or fewer
    # (Qwen3 fc1: 2-7% slower) nor for K 7168 (DSv3 fc1 EP8: c0 ahead by 0.4-4%). Dgrad (contraction = N): DSv3 fc1 EP8 (N 4096) +5%,
    # the Mixtral-like fc2 at EP=2 (N 4096) +4-5%, Qwen3 (N 1536) +2%; c0 stays ahead for N 7168+.
    Rule("fwd", 2048, 2, min_rows=256, max_k=4096),
    Rule("dgrad", 2048, 2, max_k=4096),
    Rule("*", None, 0),       # large M: cooperative 128x256, cluster 2x1
)


def choose_config(direction: str, num_rows: int, n: int, k: int, num_groups: int, sm_count: int = 132,
                  group_sizes: Optional[Sequence[int]] = None) -> int:
    """Config id for one call. ``n``/``k`` are the user-level out/in features; ``group_sizes`` the
    rows of each group when the caller has them on the host (the MoE layer does), else None.
    No rows at all (every expert empty): nothing runs, and the answer is the catch-all row's tile."""
    if num_rows <= 0:
        return RULES[-1].config
    m_avg = num_rows / max(num_groups, 1)
    ragged = group_sizes is not None and len(set(group_sizes)) > 1
    contraction = k if direction == "fwd" else n if direction == "dgrad" else m_avg
    out_per_group = m_avg * n if direction == "fwd" else m_avg * k if direction == "dgrad" else k * n
    for rule in RULES:
        if rule.direction not in ("*", direction) or (rule.ragged and not ragged):
            continue
        if (rule.max_rows is not None and m_avg > rule.max_rows) or m_avg <= rule.min_rows:
            continue
        if (rule.max_k is None or contraction <= rule.max_k) and out_per_group >= rule.min_out:
            return rule.config
    raise AssertionError("RULES must end with a catch-all row")
