"""The decision rule (te_dist.gemm.decide) per device class and shape region, and the tile tables.

Devices are described by their compute capability (the rule's only view of them), so no GPU is
needed; the FP8 part fakes one through the support module's hooks."""

import random
from types import SimpleNamespace

import pytest
import torch

from te_dist import settings
from te_dist.gemm import decide
from te_dist.gemm.decide import MARGIN, Problem, candidates, choose, pick_measured, static_choice, why_not

HOPPER, BLACKWELL, AMPERE = (9, 0), (10, 0), (8, 0)
YES, NO = (lambda: True), (lambda: False)
TORCH, LOOP = ("torch", None), ("loop", None)

# shape regions: (num_rows, K, N, E, host sizes)
REGIONS = {
    "decode": (64, 4096, 14336, 8, (8,) * 8),
    "small_m": (64 * 128, 4096, 2048, 64, None),
    "large_m": (8 * 4096, 4096, 28672, 8, None),
    "ragged": (sum((147, 372, 0, 219) * 8), 7168, 4096, 32, (147, 372, 0, 219) * 8),
    "few_large_long_k": (4608, 14336, 4096, 4, (1152,) * 4),
    "unseen_gpt_oss": (32 * 96, 2880, 5760, 32, None),
}


def _p(region="large_m", **kw):
    rows, k, n, e, sizes = REGIONS[region]
    base = dict(direction="fwd", device_type="cuda", capability=HOPPER, dtype=torch.bfloat16,
                out_dtype=torch.bfloat16, num_rows=rows, k=k, n=n, num_groups=e, sizes_on_host=sizes is not None)
    base.update(kw)
    return Problem(**base)


def _static(p, cutlass=YES, torch_grouped=True):
    return static_choice(p, cutlass_built=cutlass, torch_grouped=torch_grouped)


@pytest.mark.parametrize("region", sorted(REGIONS))
@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
def test_plain_bf16_defaults_to_torch_on_every_hopper_and_blackwell_shape(region, direction):
    """Without a measurement, a call torch can run entirely runs on torch's kernel: whatever the shape,
    on the GPU class our tiles were fitted on (SM 9.0) and on the next (10.0)."""
    for cap in (HOPPER, BLACKWELL):
        assert _static(_p(region, direction=direction, capability=cap)) == "torch"


@pytest.mark.parametrize("region", sorted(REGIONS))
def test_fused_epilogue_keeps_todays_rule(region):
    """A bias / row scale / float32 output: our fused epilogue on SM 9.0 (cuBLAS per expert, then the
    epilogue, for few large experts with host sizes), torch plus the separate epilogue elsewhere."""
    want = "loop" if region == "few_large_long_k" else "cutlass"
    for fused in (dict(epilogue=True), dict(out_dtype=torch.float32)):
        assert _static(_p(region, **fused)) == want
        assert _static(_p(region, capability=BLACKWELL, **fused)) == ("loop" if want == "loop" else "torch")
        assert _static(_p(region, **fused), cutlass=NO) == ("loop" if region == "few_large_long_k" else "torch")
    assert _static(_p(region, direction="wgrad", epilogue=True)) == "cutlass"  # never cuBLAS per expert


def test_device_classes_and_dtypes():
    assert _static(_p(device_type="cpu", capability=None)) == "loop"
    assert _static(_p(capability=AMPERE)) == "loop"  # no single-launch bf16 grouped kernel before SM 9.0
    assert _static(_p(capability=AMPERE, epilogue=True)) == "loop"
    for dt in (torch.float16, torch.float32):
        assert _static(_p(dtype=dt, out_dtype=dt)) == "loop"
    assert _static(_p(k=4100)) == "loop"  # off 16-byte rows
    assert "multiples of 8" in why_not("cutlass", _p(n=12), cutlass_built=YES, torch_grouped=True)
    assert _static(_p(), torch_grouped=False) == "cutlass"  # a torch without _grouped_mm
    assert _static(_p(), cutlass=NO, torch_grouped=False) == "loop"
    assert _static(_p(weight_k_major=False, epilogue=True)) == "torch"  # our kernels read K-major weights only
    assert _static(_p(direction="wgrad", weight_k_major=False, epilogue=True)) == "cutlass"


def test_cutlass_availability_is_asked_only_where_it_matters():
    asked = []
    probe = lambda: asked.append(1) or True  # noqa: E731
    assert _static(_p(), cutlass=probe) == "torch" and asked == []  # the plain call's hot path
    assert _static(_p(epilogue=True), cutlass=probe) == "cutlass" and asked == [1]


def test_capture_with_no_graph_safe_backend_raises():
    with pytest.raises(ValueError, match="CUDA graph"):
        _static(_p(dtype=torch.float32, out_dtype=torch.float32, capturing=True))
    assert _static(_p("few_large_long_k", epilogue=True, capturing=True)) == "cutlass"  # replay reuses sizes


def test_forced_backend_validated():
    pick = lambda p, forced: choose(p, cutlass_built=YES, torch_grouped=True, forced=forced)  # noqa: E731
    assert pick(_p(), "loop") == LOOP
    assert pick(_p(), "cutlass") == ("cutlass", None)
    with pytest.raises(ValueError, match="sm_90a"):
        pick(_p(capability=AMPERE), "cutlass")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        pick(_p(out_dtype=torch.float16), "cutlass")
    with pytest.raises(ValueError, match="backend must be one of"):
        pick(_p(), "magic")
    assert pick(_p(device_type="cpu", capability=None), "torch") == TORCH  # torch's CPU grouped_mm


# ---------------------------------------------------------------------- measured entries


def test_a_measured_winner_needs_the_margin_over_torch():
    p = _p()
    assert pick_measured({TORCH: 1.0, ("cutlass", 2): 0.9}, p) == ("cutlass", 2)
    assert pick_measured({TORCH: 1.0, ("cutlass", 2): 1.0 / (1 + MARGIN) + 1e-6}, p) == TORCH
    assert pick_measured({TORCH: 1.0, ("cutlass", 2): 1.2}, p) == TORCH
    assert pick_measured({("cutlass", 0): 1.0, ("cutlass", 2): 0.9}, p) == ("cutlass", 2)  # torch not measured


def test_a_measured_loop_needs_host_sizes_and_no_capture():
    ms = {TORCH: 1.0, LOOP: 0.5, ("cutlass", 0): 0.9}
    assert pick_measured(ms, _p("few_large_long_k")) == LOOP
    assert pick_measured(ms, _p("few_large_long_k", capturing=True)) == ("cutlass", 0)
    assert pick_measured(ms, _p()) == ("cutlass", 0)  # no host sizes: the loop would read the offsets
    assert pick_measured({LOOP: 0.5}, _p()) is None


def test_choose_reads_the_measurement_before_the_static_rule():
    kw = dict(cutlass_built=YES, torch_grouped=True)
    assert choose(_p(), measured={TORCH: 1.0, ("cutlass", 10): 0.5}, **kw) == ("cutlass", 10)
    assert choose(_p(epilogue=True), measured={TORCH: 1.0, ("cutlass", 2): 1.01}, **kw) == TORCH
    assert choose(_p(epilogue=True), measured={}, **kw) == ("cutlass", None)  # nothing measured: static
    assert choose(_p(), measured={LOOP: 0.1}, **kw) == TORCH  # nothing allowed: static
    assert choose(_p(), measured={TORCH: 1.0, ("cutlass", 2): 0.1}, forced="torch", **kw) == TORCH
    # our kernels turned off since the entry was measured (TE_DIST_DISABLE_CUTLASS, a failed build)
    off = dict(cutlass_built=NO, torch_grouped=True)
    assert choose(_p(), measured={TORCH: 1.0, ("cutlass", 2): 0.5}, **off) == TORCH
    assert choose(_p("few_large_long_k"), measured={TORCH: 1.0, ("cutlass", 2): 0.5, LOOP: 0.8}, **off) == LOOP


def test_random_problems_never_default_away_from_torch_and_measurements_only_by_the_margin():
    rng = random.Random(57)
    for _ in range(500):
        e = rng.randint(1, 256)
        sizes = tuple(rng.choice([0, rng.randint(1, 8192)]) for _ in range(e)) if rng.random() < 0.5 else None
        p = Problem(rng.choice(["fwd", "dgrad", "wgrad"]), "cuda", rng.choice([HOPPER, BLACKWELL]), torch.bfloat16,
                    torch.bfloat16, sum(sizes) if sizes else rng.randint(0, 1 << 20), 16 * rng.randint(32, 512),
                    16 * rng.randint(32, 512), e, rng.random() < 0.9, rng.random() < 0.1, sizes is not None)
        assert static_choice(p, cutlass_built=YES, torch_grouped=True) == "torch"
        ms = {c: rng.uniform(0.5, 2.0) for c in candidates(p, cutlass_built=YES, torch_grouped=True,
                                                           configs=(0, 2, 10), group_sizes=sizes)}
        got = pick_measured(ms, p)
        assert got == TORCH or ms[got] * (1 + MARGIN) <= ms[TORCH]


def test_candidates_torch_first_then_built_tiles_then_a_bounded_loop():
    kw = dict(cutlass_built=YES, torch_grouped=True, configs=(0, 2))
    assert candidates(_p("few_large_long_k"), group_sizes=(1152,) * 4, **kw) == [TORCH, ("cutlass", 0),
                                                                                  ("cutlass", 2), LOOP]
    many = tuple(range(1, 33))  # 32 distinct sizes: its first call would plan 32 GEMM shapes
    assert LOOP not in candidates(_p(), group_sizes=many, **kw)
    assert LOOP not in candidates(_p(capturing=True), group_sizes=(8,) * 8, **kw)
    assert candidates(_p(capability=BLACKWELL), **kw) == [TORCH]
    assert candidates(_p(dtype=torch.float32, out_dtype=torch.float32), **kw) == []


# ---------------------------------------------------------------------- FP8 rule (device faked)


def test_fp8_rule_reads_the_support_modules_answer():
    from te_dist import support as S

    cuda = torch.device("cuda", 0)
    with S.set_capability_lookup(lambda d: HOPPER if d.type == "cuda" else None), S.set_fp8_kernels_lookup(YES):
        assert decide.quantized_why_not(cuda, 4096, 4096, torch.bfloat16, "e4m3") is None
        assert "multiples of 128" in decide.quantized_why_not(cuda, 4000, 4096, torch.bfloat16, "e4m3")
        assert "e4m3" in decide.quantized_why_not(cuda, 4096, 4096, torch.bfloat16, "e5m2")
        assert "write" in decide.quantized_why_not(cuda, 4096, 4096, torch.float16, "e4m3")
        assert "CUDA" in decide.quantized_why_not(torch.device("cpu"), 4096, 4096, torch.bfloat16, "e4m3")
        # tensor scales: K and N of 16-byte rows under settings.fp8_unpadded_tensor_scales, else the 128 grid
        for unpadded, want in ((False, "multiples of 128"), (True, None)):
            with settings.override(fp8_unpadded_tensor_scales=unpadded):
                got = decide.quantized_why_not(cuda, 2880, 5760, torch.bfloat16, "e4m3", block_scales=False)
                assert got is None if want is None else want in got
                assert "multiples of 128" in decide.quantized_why_not(cuda, 2880, 5760, torch.bfloat16, "e4m3")
        with settings.override(fp8_unpadded_tensor_scales=True):
            assert "multiples of 16" in decide.quantized_why_not(cuda, 2888, 5760, torch.bfloat16, "e4m3",
                                                                 block_scales=False)
    with S.set_capability_lookup(lambda d: BLACKWELL if d.type == "cuda" else None), S.set_fp8_kernels_lookup(YES):
        assert "sm_90a" in decide.quantized_why_not(cuda, 4096, 4096, torch.bfloat16, "e4m3")


# ---------------------------------------------------------------------- tile tables

# (name, experts, rows per expert, K, N) -> configs for (fwd, dgrad, wgrad)
_TILE_TABLE = [
    ("mixtral_fc1", 8, 4096, 4096, 28672, (0, 0, 3)),
    ("dsv3_fc1_ep8", 32, 1024, 7168, 4096, (0, 2, 2)),
    ("dsv3_fc2_ep8", 32, 1024, 2048, 7168, (2, 0, 2)),
    ("qwen3_fc1", 128, 256, 2048, 1536, (0, 2, 3)),
    ("ds_layer_fc1_256", 64, 256, 7168, 4096, (0, 2, 2)),
    ("ds_layer_fc2_256", 64, 256, 2048, 7168, (0, 0, 2)),
    ("mx_layer_fc1_1024", 4, 1024, 4096, 28672, (2, 0, 2)),
    ("mx_layer_fc2_1024", 4, 1024, 14336, 4096, (0, 2, 2)),
    ("small_m_E64", 64, 128, 4096, 2048, (2, 2, 3)),
    ("decode_E8_T64", 8, 8, 4096, 14336, (1, 1, 3)),
]


@pytest.mark.parametrize("name,E,rows,K,N,want", _TILE_TABLE, ids=[t[0] for t in _TILE_TABLE])
def test_tile_config_table(name, E, rows, K, N, want):
    import cutlass_kernels

    assert tuple(cutlass_kernels.choose_config(d, E * rows, N, K, E) for d in ("fwd", "dgrad", "wgrad")) == want


def test_tile_rules_end_with_a_catch_all_and_fp8_tiles_sit_beside_them():
    import cutlass_kernels.heuristics as h
    from cutlass_kernels import fp8_block

    last = h.RULES[-1]
    assert (last.direction, last.max_rows, last.min_rows, last.max_k, last.min_out, last.ragged) == (
        "*", None, 0, None, 0, False)
    assert all(rule.config in h.CONFIGS for rule in h.RULES)  # only built-by-default tiles are chosen
    for d in ("fwd", "dgrad", "wgrad"):  # every expert empty: an answer, not an AssertionError
        assert h.choose_config(d, 0, 64, 64, 4) == last.config
    assert fp8_block.FP8_CONFIGS is h.FP8_CONFIGS
    assert h.fp8_config("wgrad", 64, 8) == h.FP8_WGRAD_CONFIG
    assert h.fp8_config("fwd", h.FP8_SMALL_M_ROWS * 8, 8) == 1 and h.fp8_config("fwd", h.FP8_SMALL_M_ROWS * 8 + 1, 8) == 0
    assert fp8_block.choose_fp8_config("fwd", 64, 8, forced=2) == 2 and fp8_block.choose_fp8_config("fwd", 64, 8) == 1
    # tensor scales: fwd and dgrad of many rows take the 192-wide tile, a fast fwd a fast tile by its contraction;
    # wgrad, block scales and few rows never do
    many = h.FP8_SMALL_M_ROWS * 8 + 1
    assert h.fp8_config("fwd", many, 8, tensor_scales=True) == h.FP8_TENSOR_CONFIG
    assert h.fp8_config("fwd", many, 8, tensor_scales=True, fast=True, contraction=h.FP8_FAST_MAX_SHORT_K) == \
        h.FP8_FAST_SHORT_K
    assert h.fp8_config("fwd", many, 8, tensor_scales=True, fast=True, contraction=7168) == h.FP8_FAST_LONG_K
    for fast_tile in (h.FP8_FAST_SHORT_K, h.FP8_FAST_LONG_K):
        assert h.FP8_CONFIGS[fast_tile][0].endswith("_fast") and h.config_fits("fwd", fast_tile, tensor_scales=True)
    assert h.config_fits("fwd", h.FP8_TENSOR_CONFIG, tensor_scales=True)
    for kwargs in (dict(), dict(fast=True, contraction=7168)):  # block scales
        assert h.fp8_config("fwd", many, 8, **kwargs) == 0
    assert h.fp8_config("dgrad", many, 8, tensor_scales=True, fast=True) == h.FP8_TENSOR_CONFIG
    # the 192-column tile only where N fills its tiles (N 1024 leaves 11% of the last tile's columns idle)
    for columns, tile in ((2048, h.FP8_TENSOR_CONFIG), (2880, h.FP8_TENSOR_CONFIG), (768, h.FP8_TENSOR_CONFIG),
                          (7168, h.FP8_TENSOR_CONFIG), (1024, 0), (512, 0), (640, 0)):
        assert h.fp8_config("dgrad", many, 8, tensor_scales=True, columns=columns) == tile, columns
        assert h.fp8_config("fwd", many, 8, tensor_scales=True, columns=columns) == tile, columns
    assert h.fp8_config("fwd", many, 8, tensor_scales=True, fast=True, contraction=1024, columns=1024) == \
        h.FP8_FAST_SHORT_K
    assert h.fp8_config("fwd", 64, 8, tensor_scales=True, fast=True) == 1
    assert h.fp8_config("wgrad", many, 8, tensor_scales=True, fast=True) == h.FP8_WGRAD_CONFIG
    assert fp8_block.choose_fp8_config("fwd", 64, 8, forced=2, fast=True) == 2


def test_ragged_host_sizes_pick_config_10_for_forward_and_dgrad_of_64_to_768_rows():
    from cutlass_kernels import choose_config

    ragged = [147, 372, 246, 219] * 8
    T = sum(ragged)
    for d in ("fwd", "dgrad"):
        assert choose_config(d, T, 4096, 7168, 32, group_sizes=ragged) == 10
        assert choose_config(d, T, 4096, 7168, 32) != 10
        big = [4 * r for r in ragged]  # 984 rows on average: past the range
        assert choose_config(d, 4 * T, 4096, 7168, 32, group_sizes=big) == choose_config(d, 4 * T, 4096, 7168, 32)
        small = [r // 8 for r in ragged]
        assert choose_config(d, sum(small), 4096, 7168, 32, group_sizes=small) == 1
    assert choose_config("wgrad", T, 4096, 7168, 32, group_sizes=ragged) == choose_config("wgrad", T, 4096, 7168, 32)


# ---------------------------------------------------------------------- the call path's wiring (GPU faked)


@pytest.fixture
def fake_gpus(monkeypatch):
    """cuda:0 an SM 9.0 GPU with our kernels built (tiles 0 and 2), cuda:1 an SM 10.0 one; a fresh
    process tuner timing with fake_timing's table (no GPU touched)."""
    from fake_timing import MS, FakeTimer
    from te_dist import support as S
    from te_dist.gemm import cutlass_backend, entry, measure

    monkeypatch.setattr(cutlass_backend, "is_available", lambda device: True)
    monkeypatch.setattr(entry, "_built_tiles", lambda p: (0, 2) if p.capability == HOPPER else ())
    timer = FakeTimer(MS)
    measure.reset(measure.Tuner(measure.TunerSettings(persist=False), timer=timer, identity=lambda i: (f"GPU{i}", 132)))
    with S.set_capability_lookup(lambda d: {0: HOPPER, 1: BLACKWELL}[d.index] if d.type == "cuda" else None), \
            settings.override(tune=True):
        yield entry, timer
    measure.reset()


def _device_problem(index, **kw):
    from te_dist import support as S

    return _p("few_large_long_k", capability=S.device_capability(torch.device("cuda", index)), **kw)


def test_the_call_path_measures_once_per_bucket_and_reads_the_entry(fake_gpus):
    entry, timer = fake_gpus
    sizes = REGIONS["few_large_long_k"][4]
    run = lambda c: c  # noqa: E731 - a "call" returns its choice, which the fake timer looks up
    p = _device_problem(0)
    assert entry._choose(p, torch.device("cuda", 0), None, sizes, run) == ("cutlass", 2)  # 0.6 ms vs torch's 0.8
    timed = {c for c, _ in timer.calls}
    assert timed == {("torch", None), ("cutlass", 0), ("cutlass", 2), ("loop", None)}  # tile 10 is not built
    n = len(timer.calls)
    assert entry._choose(p, torch.device("cuda", 0), None, sizes, run) == ("cutlass", 2) and len(timer.calls) == n
    # the other GPU class has its own table: torch and the loop only; torch (0.8) beats the loop (2.0)
    assert entry._choose(_device_problem(1), torch.device("cuda", 1), None, sizes, run) == TORCH
    assert {c for c, _ in timer.calls[n:]} == {("torch", None), ("loop", None)}
    # a forced backend never measures
    assert entry._choose(_device_problem(0, k=1024), torch.device("cuda", 0), "torch", sizes, run) == TORCH


def test_the_call_paths_remembered_choice_follows_the_table_settings_and_device(fake_gpus, monkeypatch):
    """A call's choice is remembered (no Problem built, nothing timed again) and decided again once the
    settings, torch's determinism, the capability lookup or the tuner's tables change."""
    from te_dist import support as S
    from te_dist.gemm import measure

    entry, timer = fake_gpus
    monkeypatch.setattr(entry, "_function", lambda direction, choice: lambda *args: choice)  # the fake timer reads it
    rows, k, n, e, sizes = REGIONS["few_large_long_k"]
    row = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, shape=(rows, k), is_cuda=True,
                          is_cpu=False)
    built = []
    problem = entry._problem
    monkeypatch.setattr(entry, "_problem", lambda *args: built.append(args) or problem(*args))

    def choice(epilogue=False):  # a bf16 forward of w's [E, N, K] layout, host sizes given
        return entry._runner("fwd", (torch.bfloat16, sizes), row, row.device, row.dtype, (e, k, n), (n * k, 1, k),
                             epilogue, None)()  # the remembered function, called: its choice

    assert choice() == ("cutlass", 2) and len(built) == 1  # measured: 0.6 ms against torch's 0.8
    timed = len(timer.calls)
    assert choice() == ("cutlass", 2) and len(built) == 1 and len(timer.calls) == timed  # remembered
    with settings.override(tune=False):
        assert choice() == TORCH and len(built) == 2  # the static rule
    with settings.override(tune=False):
        assert choice(epilogue=True) == LOOP and choice(epilogue=True) == LOOP and len(built) == 4  # a loop: never kept
    assert choice() == ("cutlass", 2) and len(built) == 5 and len(timer.calls) == timed  # the entry, read again
    with monkeypatch.context() as patched:
        patched.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        assert choice() == TORCH and len(built) == 6  # deterministic, not agreed: the static rule
    with S.set_capability_lookup(lambda d: BLACKWELL):  # no cutlass there: torch, the measured runner-up
        assert choice() == TORCH and len(built) == 7
    assert choice() == ("cutlass", 2) and len(built) == 8 and len(timer.calls) == timed
    p = entry._problem("fwd", row, (e, k, n), (n * k, 1, k), torch.bfloat16, sizes, False)
    measure.tuner().adopt({"GPU0|sm132": {measure.key_text(measure.bucket_key(p, sizes)): {"torch": 0.8,
                                                                                             "cutlass:0": 0.5}}})
    assert choice() == ("cutlass", 0) and len(timer.calls) == timed  # rank 0's entries
    measure.configure(directory="unused")  # the tables start over: measured again
    assert choice() == ("cutlass", 2) and len(timer.calls) > timed


def test_the_call_path_without_measuring_is_the_static_rule(fake_gpus):
    from te_dist.gemm import measure

    entry, timer = fake_gpus
    run = lambda c: c  # noqa: E731
    with settings.override(tune=False):
        for index, want_fused in ((0, ("cutlass", None)), (1, TORCH)):
            dev = torch.device("cuda", index)
            assert entry._choose(_device_problem(index, sizes_on_host=False), dev, None, None, run) == TORCH
            assert entry._choose(_device_problem(index, sizes_on_host=False, epilogue=True), dev, None, None,
                                 run) == want_fused
    assert timer.calls == []
