"""Backend selection table (pure function; devices described, none needed)."""

import pytest
import torch

from te_dist.backends.selection import Problem, choose_backend, why_not


def _p(**kw):
    base = dict(direction="fwd", device_type="cuda", capability=(9, 0), dtype=torch.bfloat16,
                out_dtype=torch.bfloat16, num_rows=4096, k=4096, n=2048, num_groups=8)
    base.update(kw)
    return Problem(**base)


def test_cpu_always_loop():
    assert choose_backend(_p(device_type="cpu", capability=None), cutlass_built=True, torch_grouped=True) == "loop"


def test_hopper_bf16_prefers_cutlass_then_torch():
    assert choose_backend(_p(), cutlass_built=True, torch_grouped=True) == "cutlass"
    assert choose_backend(_p(), cutlass_built=False, torch_grouped=True) == "torch"
    assert choose_backend(_p(), cutlass_built=False, torch_grouped=False) == "loop"


def test_blackwell_uses_torch_not_sm90a_kernels():
    assert choose_backend(_p(capability=(10, 0)), cutlass_built=True, torch_grouped=True) == "torch"


def test_fp16_and_fp32_fall_back_to_loop():
    for dt in (torch.float16, torch.float32):
        assert choose_backend(_p(dtype=dt, out_dtype=dt), cutlass_built=True, torch_grouped=True) == "loop"


def test_misaligned_k_or_n_skips_tma_backends():
    assert choose_backend(_p(k=4100), cutlass_built=True, torch_grouped=True) == "loop"
    assert "multiples of 8" in why_not("cutlass", _p(n=12), cutlass_built=True, torch_grouped=True)


def test_non_k_major_weight_skips_cutlass_forward_only():
    assert choose_backend(_p(weight_k_major=False), cutlass_built=True, torch_grouped=True) == "torch"
    assert choose_backend(_p(direction="wgrad", weight_k_major=False), cutlass_built=True, torch_grouped=True) == "cutlass"


def test_decode_shapes_use_loop_unless_capturing(monkeypatch):
    from te_dist.backends import selection

    monkeypatch.setattr(selection, "DECODE_ROWS_PER_EXPERT", 8)
    rows = 8 * 8
    assert choose_backend(_p(num_rows=rows), cutlass_built=False, torch_grouped=True) == "loop"
    assert choose_backend(_p(num_rows=rows, capturing=True), cutlass_built=False, torch_grouped=True) == "torch"
    assert choose_backend(_p(num_rows=rows + 1), cutlass_built=False, torch_grouped=True) == "torch"


def test_capture_with_no_graph_safe_backend_raises():
    with pytest.raises(ValueError, match="CUDA graph"):
        choose_backend(_p(dtype=torch.float32, out_dtype=torch.float32, capturing=True),
                       cutlass_built=True, torch_grouped=True)


def test_forced_backend_validated():
    assert choose_backend(_p(), cutlass_built=True, torch_grouped=True, forced="loop") == "loop"
    with pytest.raises(ValueError, match="sm_90a"):
        choose_backend(_p(capability=(8, 0)), cutlass_built=True, torch_grouped=True, forced="cutlass")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        choose_backend(_p(out_dtype=torch.float16), cutlass_built=True, torch_grouped=True, forced="cutlass")
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_backend(_p(), cutlass_built=True, torch_grouped=True, forced="magic")


# (name, experts, rows per expert, K, N) -> configs for (fwd, dgrad, wgrad), as fitted in docs/kernels.md
_TILE_TABLE = [
    ("mixtral_fc1", 8, 4096, 4096, 28672, (0, 0, 3)),
    ("dsv3_fc1_ep8", 32, 1024, 7168, 4096, (0, 2, 2)),  # dgrad contracts over N 4096: ping-pong
    ("dsv3_fc2_ep8", 32, 1024, 2048, 7168, (2, 0, 2)),  # short forward K with many rows: ping-pong
    ("qwen3_fc1", 128, 256, 2048, 1536, (0, 2, 3)),  # short K but 256 rows: cooperative forward
    ("ds_layer_fc1_256", 64, 256, 7168, 4096, (0, 2, 2)),  # short-K wgrad, 29M outputs per expert
    ("ds_layer_fc2_256", 64, 256, 2048, 7168, (0, 0, 2)),
    ("mx_layer_fc1_1024", 4, 1024, 4096, 28672, (2, 0, 2)),
    ("mx_layer_fc2_1024", 4, 1024, 14336, 4096, (0, 2, 2)),
    ("small_m_E64", 64, 128, 4096, 2048, (2, 2, 3)),
    ("decode_E8_T64", 8, 8, 4096, 14336, (1, 1, 3)),
]


@pytest.mark.parametrize("name,E,rows,K,N,want", _TILE_TABLE, ids=[t[0] for t in _TILE_TABLE])
def test_tile_config_table(name, E, rows, K, N, want):
    import cutlass_kernels

    got = tuple(cutlass_kernels.choose_config(d, E * rows, N, K, E) for d in ("fwd", "dgrad", "wgrad"))
    assert got == want


def test_tile_rules_end_with_a_catch_all():
    import cutlass_kernels.heuristics as h

    last = h.RULES[-1]
    assert (last.direction, last.max_rows, last.min_rows, last.max_k, last.min_out, last.ragged) == (
        "*", None, 0, None, 0, False)
    assert all(rule.config in h.CONFIGS for rule in h.RULES)  # only built-by-default tiles are chosen
    # No rows (every expert empty, as Megatron's no-tokens test sends): an answer, not an AssertionError.
    for d in ("fwd", "dgrad", "wgrad"):
        assert h.choose_config(d, 0, 64, 64, 4) == last.config
        assert h.choose_config(d, 0, 64, 64, 4, group_sizes=[0, 0, 0, 0]) == last.config


def test_ragged_host_sizes_pick_config_10_for_forward_and_dgrad_of_64_to_768_rows():
    from cutlass_kernels import choose_config

    ragged = [147, 372, 246, 219] * 8  # 32 experts, 246 rows on average (DeepSeek-like, EP=2)
    T = sum(ragged)
    for d in ("fwd", "dgrad"):
        assert choose_config(d, T, 4096, 7168, 32, group_sizes=ragged) == 10
        assert choose_config(d, T, 4096, 7168, 32) != 10  # without the sizes: the equal-split table
        # equal host sizes are what that table was fitted on
        assert choose_config(d, 256 * 32, 4096, 7168, 32, group_sizes=[256] * 32) == choose_config(d, 256 * 32, 4096, 7168, 32)
        wide = [3 * r for r in ragged]  # 738 rows on average: still config 10
        assert choose_config(d, 3 * T, 4096, 7168, 32, group_sizes=wide) == 10
        big = [4 * r for r in ragged]  # 984 rows on average: past the range (config 10 lost at 1024)
        assert choose_config(d, 4 * T, 4096, 7168, 32, group_sizes=big) == choose_config(d, 4 * T, 4096, 7168, 32)
        small = [r // 8 for r in ragged]  # ~30 rows: the decode tile
        assert choose_config(d, sum(small), 4096, 7168, 32, group_sizes=small) == 1
    # wgrad contracts over the rows: nothing is padded, the table's pick stands
    assert choose_config("wgrad", T, 4096, 7168, 32, group_sizes=ragged) == choose_config("wgrad", T, 4096, 7168, 32)


def _mixtral_like(**kw):
    # fc2 forward at EP=2: 4 local experts, ~1150 rows each, K 14336 (the ragged sweep's winner row).
    base = dict(num_rows=4608, k=14336, n=4096, num_groups=4, sizes_on_host=True)
    base.update(kw)
    return _p(**base)


def test_cublas_per_expert_needs_host_sizes_few_large_groups_and_long_contraction():
    pick = lambda p: choose_backend(p, cutlass_built=True, torch_grouped=True)  # noqa: E731
    assert pick(_mixtral_like()) == "loop"
    assert pick(_mixtral_like(direction="dgrad")) == "loop"
    assert pick(_mixtral_like(sizes_on_host=False)) == "cutlass"  # the loop would have to read the offsets
    assert pick(_mixtral_like(capturing=True)) == "cutlass"  # replay would reuse this step's sizes
    assert pick(_mixtral_like(direction="wgrad")) == "cutlass"  # our ping-pong wgrad won every row
    assert pick(_mixtral_like(k=4096)) == "cutlass"  # short contraction
    assert pick(_mixtral_like(num_groups=32)) == "cutlass"  # many experts (DeepSeek-like)
    assert pick(_mixtral_like(num_rows=4 * 511)) == "cutlass"  # small groups


def test_cublas_per_expert_thresholds_are_the_named_constants(monkeypatch):
    from te_dist.backends import selection

    p = _mixtral_like()
    monkeypatch.setattr(selection, "LOOP_MIN_CONTRACTION", p.k + 1)
    assert choose_backend(p, cutlass_built=True, torch_grouped=True) == "cutlass"
    monkeypatch.setattr(selection, "LOOP_MIN_CONTRACTION", p.k)
    monkeypatch.setattr(selection, "LOOP_MAX_GROUPS", p.num_groups - 1)
    assert choose_backend(p, cutlass_built=True, torch_grouped=True) == "cutlass"
