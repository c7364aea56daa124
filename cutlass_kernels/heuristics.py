"""Tile choice per problem shape, bf16 and FP8 (apart from launch code; read it as two tables).

bf16 tiles compiled from grouped_gemm.cu (``CONFIGS``; id: schedule, tile M x N x K, cluster):

| id | schedule    | tile          | cluster | meant for |
|----|-------------|---------------|---------|-----------|
| 0  | cooperative | 128 x 256 x 64 | 2x1x1  | large M per expert: 2 consumer warpgroups share one big tile, B multicast along M |
| 1  | ping-pong   | 64 x 128 x 64  | 1x1x1  | decode (a few rows per expert): smallest wgmma M, least padding |
| 2  | ping-pong   | 128 x 128 x 64 | 1x2x1  | small M (64..256 rows per expert): one M tile per expert; A multicast along N |
| 3  | cooperative | 256 x 128 x 64 | 1x2x1  | large M, wide N-multicast alternative to 0 |
| 10 | ping-pong   | 64 x 256 x 64  | 1x1x1  | ragged groups: 64-row padding, no cluster rounding, the widest wgmma per warpgroup |

Ids 4-9, 11-15: candidates that lost (ids keep their meaning). ``RULES`` picks a tile per call (first match) by rows per
expert (fwd/dgrad's M, wgrad's K), contraction, output per group and ragged host sizes, fitted on sweeps (docs/kernels.md
"Tiles"); te_dist runs them by default only where torch lacks the fused epilogue, or where a measurement says so.

FP8 tiles compiled from fp8_block_gemm.cu (``FP8_CONFIGS``; TILE_K is the scale block, 128), picked by ``fp8_config``:

| id | schedule    | tile M x N | cluster | meant for |
|----|-------------|------------|---------|-----------|
| 0  | cooperative | 128 x 128  | 1 x 2   | many rows per expert: block-scaled fwd and dgrad |
| 1  | ping-pong   | 64 x 128   | 1 x 1   | few rows per expert (<= ``FP8_SMALL_M_ROWS`` on average): 64-row padding |
| 3  | cooperative | 128 x 192  | 1 x 1   | tensor-scaled fwd and dgrad whose N fills 192-column tiles (``FP8_MIN_FILL``) |
| 7  | cooperative, fast | 128 x 256 | 1 x 2 | tensor-scaled fwd with ``fast`` over ``FP8_FAST_MAX_SHORT_K`` of contraction |
| 8  | ping-pong, fast | 128 x 128 | 1 x 2 | the same up to it: a short mainloop, so the overlapped epilogue pays |
| 11 | cooperative | 128 x 128  | 1 x 2   | every wgrad: config 0 with a 128 x 64 epilogue sub-tile (CUTLASS's: 128 x 32) |

Fast (``_fast``): all of K in the tensor cores' accumulator, never promoted into a second fp32 one (TE's forward
default; te_dist.settings.fp8_fprop_fast_accum), which frees the registers these wider tiles need. 11: a wgrad's short
contraction (one expert's tokens) leaves its epilogue heavy. Ids 2, 4-6, 9, 10, 12 lost (docs/kernels.md, FP8 tiles).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

__all__ = ["CONFIGS", "Rule", "RULES", "choose_config", "FP8_CONFIGS", "FP8_WGRAD_CONFIG",
           "FP8_SMALL_M_ROWS", "FP8_TENSOR_CONFIG", "FP8_FAST_LONG_K", "FP8_FAST_SHORT_K",
           "FP8_FAST_MAX_SHORT_K", "FP8_MIN_FILL", "config_fits", "fp8_config"]

# id: (schedule, tile M, tile N, tile K, (cluster M, cluster N)); build.py turns these into macros.
CONFIGS = {
    0: ("cooperative", 128, 256, 64, (2, 1)),
    1: ("pingpong", 64, 128, 64, (1, 1)),
    2: ("pingpong", 128, 128, 64, (1, 2)),
    3: ("cooperative", 256, 128, 64, (1, 2)),
    10: ("pingpong", 64, 256, 64, (1, 1)),
}


class Rule(NamedTuple):
    """One row: it holds when the direction matches and the call's average rows per expert lie in
    (min_rows, max_rows], its contraction (fwd: K, dgrad: N, wgrad: the rows) is at most max_k,
    each group's output has at least min_out elements (fwd: rows x N, dgrad: rows x K, wgrad:
    K x N) and, for a ``ragged`` row, the host sizes are given and unequal. None = no bound."""

    direction: str  # "fwd", "dgrad", "wgrad" or "*"
    max_rows: Optional[int]
    config: int
    min_rows: int = 0
    max_k: Optional[int] = None
    min_out: int = 0
    ragged: bool = False


RULES = (
    Rule("wgrad", 512, 2, min_rows=128, min_out=1 << 23),  # short-K wgrad, large outputs: ping-pong hides the epilogue
    Rule("wgrad", 512, 3),    # short K loops: cooperative 256x128
    Rule("wgrad", 2048, 2),
    Rule("wgrad", None, 3),
    Rule("*", 768, 10, min_rows=64, ragged=True),  # ragged groups pad each group to whole M tiles: 64 rows
    Rule("*", 32, 1),         # decode: 64-row tiles waste least
    Rule("*", 128, 2),        # small M: one 128-row tile per expert, no idle cluster half
    Rule("fwd", 2048, 2, min_rows=256, max_k=4096),  # contraction <= 4096: ping-pong overlaps the epilogue
    Rule("dgrad", 2048, 2, max_k=4096),
    Rule("*", None, 0),       # large M: cooperative 128x256, cluster 2x1
)


def choose_config(direction: str, num_rows: int, n: int, k: int, num_groups: int,
                  group_sizes: Optional[Sequence[int]] = None) -> int:
    """bf16 tile for one call. ``n``/``k``: the user-level out/in features; ``group_sizes``: the rows
    of each group when the caller has them on the host, else None. No rows at all: nothing runs, and
    the answer is the catch-all row's tile."""
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


# id: (schedule, tile M, tile N, (cluster M, cluster N)[, epilogue sub-tile N]); "_fast": fast accumulation
FP8_CONFIGS = {
    0: ("cooperative", 128, 128, (1, 2)),
    1: ("pingpong", 64, 128, (1, 1)),
    3: ("cooperative", 128, 192, (1, 1)),
    7: ("cooperative_fast", 128, 256, (1, 2)),
    8: ("pingpong_fast", 128, 128, (1, 2)),
    11: ("cooperative", 128, 128, (1, 2), 64),
}
FP8_WGRAD_CONFIG, FP8_SMALL_M_ROWS = 11, 192


def config_fits(direction: str, config: int, tensor_scales: bool = False) -> bool:
    """The tile's N covers 128-column weight scale blocks in block-scaled fwd/dgrad; fast tiles: tensor-scaled fwd."""
    if FP8_CONFIGS[config][0].endswith("_fast"):
        return tensor_scales and direction == "fwd"
    return direction == "wgrad" or tensor_scales or FP8_CONFIGS[config][2] % 128 == 0


FP8_TENSOR_CONFIG, FP8_FAST_LONG_K, FP8_FAST_SHORT_K, FP8_FAST_MAX_SHORT_K, FP8_MIN_FILL = 3, 7, 8, 3072, 0.95


def fp8_config(direction: str, num_rows: int, num_groups: int, *, tensor_scales: bool = False, fast: bool = False,
               contraction: int = 0, columns: int = 0) -> int:
    """FP8 tile for one call (the table above): by the rows per expert for fwd/dgrad (wgrad's M: out-features), then
    tensor scales' tiles: a fast fwd's by its contraction, 192 columns where ``columns`` fill them to ``FP8_MIN_FILL``."""
    if direction == "wgrad":
        return FP8_WGRAD_CONFIG
    if num_rows <= FP8_SMALL_M_ROWS * max(num_groups, 1):
        return 1
    if not tensor_scales:
        return 0
    if fast and direction == "fwd":
        return FP8_FAST_SHORT_K if contraction <= FP8_FAST_MAX_SHORT_K else FP8_FAST_LONG_K
    return FP8_TENSOR_CONFIG if columns <= 0 or columns / (-(-columns // 192) * 192) >= FP8_MIN_FILL else 0
