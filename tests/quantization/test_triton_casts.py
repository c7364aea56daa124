"""Fused Triton casts (``triton_casts``) == the eager cast functions (``cast``), bit for bit.

Three groups:
* policy tests (always run, no Triton needed): the switch, the lazy loader, the fallback;
* ``cpu`` cases: the kernels run in Triton's interpreter on CPU tensors. They need ``triton``
  AND ``TRITON_INTERPRET=1`` set before Triton is imported, else they are skipped (CI has no Triton):
  ``TRITON_INTERPRET=1 python -m pytest -q --timeout 300 tests/quantization/test_triton_casts.py``
  The interpreter's own float conversions are wrong for fp32 -> E4M3 (rounds ties away, breaks
  subnormals, turns NaN into 256) and for bf16/fp16 subnormals -> fp32 (flushes them), so the ``cpu``
  cases route those conversions through torch (which rounds like the GPU's ``cvt.rn``): they check the
  kernels' logic (amax, scales, layouts, masks), and the ``cuda`` cases check the hardware casts too;
* ``cuda`` cases (``gpu`` marker): the real kernels on the GPU against eager torch on the GPU.
NaN compares as NaN (payloads may differ); everything else compares bitwise.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

from te_dist import recipe as R
from te_dist import settings
from te_dist.quantization import cast, fused, make_quantizer, set_fused_casts_enabled
from triton_interpreter import patch_interpreter_conversions

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not (HAS_TRITON and INTERPRET), reason="Triton interpreter run: needs triton and TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_TRITON, reason="needs triton")]),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
E4M3 = (torch.float8_e4m3fn, 448.0)
E5M2 = (torch.float8_e5m2, 57344.0)


# ----------------------------------------------------------------------------- fixtures and helpers
@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    if request.param == "cpu":
        patch_interpreter_conversions(monkeypatch)
    return torch.device(request.param)


@pytest.fixture
def kernels():
    from te_dist.quantization import triton_casts

    return triton_casts


@pytest.fixture
def rowcol():
    from te_dist.quantization import triton_rowcol

    return triton_rowcol


@pytest.fixture
def nvfp4_kernels():
    from te_dist.quantization import triton_nvfp4

    return triton_nvfp4


@pytest.fixture
def reference_mode():
    """Eager reference on every device while the test runs."""
    with settings.override(torch_compile=False):
        yield


def _assert_same(actual, expected, what=""):
    """Bitwise equality with NaN == NaN (any payload)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
    a_nan, e_nan = torch.isnan(actual.float()), torch.isnan(expected.float())
    assert torch.equal(a_nan, e_nan), f"{what}: NaN positions differ"
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
    a_bits, e_bits = actual.view(ints).cpu(), expected.view(ints).cpu()
    keep = ~a_nan.cpu()
    diff = (a_bits != e_bits) & keep
    if diff.any():
        first = diff.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} values differ, first at {first}")


def _data(shape, dtype, device, seed=0, specials=True):
    """Random values over many magnitudes plus crafted blocks: zeros, NaN, +-Inf, tiny (subnormal), huge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    if specials:
        flat = x.view(-1, shape[-1])
        rows, cols = flat.shape
        big = torch.finfo(dtype).max / 4
        tiny = torch.finfo(dtype).smallest_normal / 8  # subnormal in the input dtype
        flat[0, :] = 0.0  # an all-zero row / block
        if rows > 1:
            flat[1, 3] = float("nan")
        if rows > 2:
            flat[2, : min(cols, 32)] = tiny  # a block of subnormals
        if rows > 3:
            flat[3, -1] = float("inf")
            flat[3, 0] = -float("inf")
        if rows > 4:
            flat[4, 1] = big
        if rows > 5:
            flat[5, :] = flat[5, :] * 1e-30 if dtype != torch.float16 else flat[5, :] * 1e-6
        flat[-1, -1] = -0.0
    return x.to(dtype).to(device)


# ----------------------------------------------------------------------------- per-tensor
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("power_2", [False, True], ids=["fp32", "pow2"])
def test_current_scaling(device, kernels, dtype, fmt, power_2):
    for shape, specials in (((48, 160), False), ((3, 5, 7), False), ((48, 160), True)):
        x = _data(shape, dtype, device, specials=specials)
        if specials:  # NaN / Inf amax -> fallback scale; check a finite tensor with tiny and huge values too
            for case in (x, torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)):
                data, scale_inv = kernels.current_scaling_quantize(case, *fmt, power_2)
                ref_data, ref_scale_inv = cast.current_scaling_quantize(case, *fmt, power_2)
                _assert_same(data, ref_data, "data")
                _assert_same(scale_inv, ref_scale_inv, "scale_inv")
            continue
        data, scale_inv = kernels.current_scaling_quantize(x, *fmt, power_2)
        ref_data, ref_scale_inv = cast.current_scaling_quantize(x, *fmt, power_2)
        _assert_same(data, ref_data, "data")
        _assert_same(scale_inv, ref_scale_inv, "scale_inv")


@pytest.mark.parametrize("amax_case", ["zero", "subnormal", "tiny", "huge", "nan", "inf"])
def test_current_scaling_special_amax(device, kernels, amax_case):
    value = {"zero": 0.0, "subnormal": 2.0**-140, "tiny": 1e-37, "huge": 2.0**127 * 1.5,
             "nan": float("nan"), "inf": float("inf")}[amax_case]
    x = torch.full((4, 64), 2.0**-141, device=device)
    x[1, 7] = value
    x[2, 9] = -2.0**-149  # smallest subnormal
    for power_2 in (False, True):
        data, scale_inv = kernels.current_scaling_quantize(x, *E4M3, power_2)
        ref_data, ref_scale_inv = cast.current_scaling_quantize(x, *E4M3, power_2)
        _assert_same(data, ref_data, f"data {amax_case}")
        _assert_same(scale_inv, ref_scale_inv, f"scale_inv {amax_case}")
    _assert_same(kernels.compute_amax(x), cast.compute_amax(x), "amax")


def test_cast_from_amax_and_cast_and_amax(device, kernels):
    x = _data((40, 96), torch.bfloat16, device, specials=False)
    amax = torch.tensor(7.25, device=device)
    data, scale_inv = kernels.cast_from_amax(x, amax, *E5M2, True)
    scale = cast.per_tensor_scale(amax, E5M2[1], power_2=True)
    _assert_same(data, cast.cast_fp8_per_tensor(x, scale, *E5M2), "data")
    _assert_same(scale_inv, 1.0 / scale, "scale_inv")
    scale = torch.tensor(3.7, device=device)
    data, amax = kernels.cast_and_amax(x.t(), scale, *E4M3)  # non-contiguous input
    _assert_same(data, cast.cast_fp8_per_tensor(x.t(), scale, *E4M3), "data")
    _assert_same(amax, cast.compute_amax(x), "amax")


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delayed_scaling_history_over_calls(device, kernels, algo, dtype):
    """Six calls with a history of 4 (roll-over), margin 1, a NaN step, a zero step and an Inf step."""
    history = torch.zeros(4, device=device)
    scale = torch.ones((), device=device)
    ref_history, ref_scale = history.clone(), scale.clone()
    for step in range(6):
        x = _data((24, 160), dtype, device, seed=step, specials=False) * (step + 1)
        if step == 2:
            x[5, 5] = float("nan")
        if step == 3:
            x.zero_()
        if step == 4:
            x[0, 0] = float("inf")
        old_history, old_scale = history.clone(), scale.clone()
        out = kernels.delayed_scaling_step(x, scale, history, *E4M3, 1, algo)
        ref = cast.delayed_scaling_step(x, ref_scale, ref_history, *E4M3, 1, algo)
        for name, a, b in zip(("data", "history", "scale", "scale_inv"), out, ref):
            _assert_same(a, b, f"step {step} {name}")
        _assert_same(history, old_history, "input history untouched")
        _assert_same(scale, old_scale, "input scale untouched")
        _, history, scale, _ = out
        _, ref_history, ref_scale, _ = ref


# (rows, cols): rows not a multiple of the 64-row tile, columns not a multiple of the 128-column one;
# stacks of matrices (a grouped weight [E, N, K]): each matrix transposed on its own
_ROWCOL_SHAPES = [(48, 160), (132, 96), (4, 8), (256, 384), (3, 68, 136), (2, 2, 8, 40)]


def _t(data):
    return data.transpose(-1, -2).contiguous()


# ----------------------------------------------------------------------------- one-pass CUDA rowcol cast
_ONE_PASS_SHAPES = [(64, 128), (2, 128, 256), (3, 192, 384)]


def _reference_rowcol(x, scale, fp8_dtype, fmt_max, amax_bits=None):
    """What cast_rowcol.cu computes, in torch: the plain cast, its transpose, amax bits merged."""
    data = cast.cast_fp8_per_tensor(x, scale.reshape(()), fp8_dtype, fmt_max)
    if amax_bits is not None:
        bits = x.float().abs().view(torch.int32).max() if x.numel() else torch.tensor(0, dtype=torch.int32)
        amax_bits[0] = torch.maximum(amax_bits[0], bits.to(amax_bits.device))
    return data, _t(data)


@pytest.fixture
def one_pass(device, monkeypatch):
    """settings.cuda_rowcol_cast on; on the CPU the CUDA kernel is replaced by its torch reference, so
    the interpreter checks the glue (scale kernel, history roll, layouts) and the GPU the kernel itself."""
    from te_dist.quantization import cuda_rowcol

    if device.type == "cpu":
        monkeypatch.setattr(cuda_rowcol, "enabled_for", lambda x, fp8_dtype: (
            x.shape[-2] % cuda_rowcol.TILE_ROWS == 0 and x.shape[-1] % cuda_rowcol.TILE_COLS == 0))
        monkeypatch.setattr(cuda_rowcol, "cast_rowcol", _reference_rowcol)
    with settings.override(cuda_rowcol_cast=True):
        yield cuda_rowcol


def _rowcol_shapes(request, path):
    """The shapes a rowcol test runs: any for the Triton two-pass path; tiles of the one-pass cast with
    it on (the ``one_pass`` fixture)."""
    if path == "two_pass":
        return _ROWCOL_SHAPES
    one_pass = request.getfixturevalue("one_pass")
    assert all(one_pass.enabled_for(torch.empty(s, device=request.getfixturevalue("device")), torch.float8_e4m3fn)
               for s in _ONE_PASS_SHAPES)
    return _ONE_PASS_SHAPES


@pytest.mark.parametrize("path", ["two_pass", "one_pass"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("power_2", [False, True])
def test_per_tensor_casts_with_transposed_data(request, device, rowcol, dtype, power_2, path):
    """The per-tensor casts that also write the transposed data: the same bytes as the plain cast,
    transposed, for current scaling (amax from x or given) and delayed scaling (amax recorded); by the
    Triton cast and transpose, and by the one-pass CUDA cast (``settings.cuda_rowcol_cast``)."""
    for seed, shape in enumerate(_rowcol_shapes(request, path)):
        x = _data(shape, dtype, device, seed=seed, specials=seed == 0)
        data, data_t, scale_inv = rowcol.current_scaling_quantize_rowcol(x, *E4M3, power_2)
        ref_data, ref_scale_inv = cast.current_scaling_quantize(x, *E4M3, power_2)
        _assert_same(data, ref_data, f"{shape} data")
        _assert_same(data_t, _t(ref_data), f"{shape} data_t")
        _assert_same(scale_inv, ref_scale_inv, f"{shape} scale_inv")
        amax = torch.tensor(5.5, device=device)
        data, data_t, scale_inv = rowcol.cast_from_amax_rowcol(x, amax, *E5M2, power_2)
        scale = cast.per_tensor_scale(amax, E5M2[1], power_2=power_2)
        ref_data = cast.cast_fp8_per_tensor(x, scale, *E5M2)
        _assert_same(data, ref_data, f"{shape} data from amax")
        _assert_same(data_t, _t(ref_data), f"{shape} data_t from amax")
        _assert_same(scale_inv, 1.0 / scale, f"{shape} scale_inv from amax")


@pytest.mark.parametrize("path", ["two_pass", "one_pass"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_delayed_scaling_with_transposed_data(request, device, rowcol, dtype, path):
    history, scale = torch.zeros(4, device=device), torch.full((), 3.0, device=device)
    for step, shape in enumerate(_rowcol_shapes(request, path)):
        x = _data(shape, dtype, device, seed=step, specials=step == 1)
        out = rowcol.delayed_scaling_step_rowcol(x, scale, history, *E4M3, 1, "max")
        ref = cast.delayed_scaling_step(x, scale, history, *E4M3, 1, "max")
        _assert_same(out[1], _t(ref[0]), f"step {step} data_t")
        for name, a, b in zip(("data", "history", "scale", "scale_inv"), (out[0], *out[2:]), ref):
            _assert_same(a, b, f"step {step} {name}")
        history, scale = out[2], out[3]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON or not torch.cuda.is_available(), reason="needs triton and a CUDA GPU")
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_rolls_the_history_after_every_program(rowcol, algo):
    """The cast's last program to finish rolls the history: with hundreds of programs per cast (and one
    whose largest value sits in a random program each step), 40 steps stay bit-identical to the
    eager reference, data, history, scale and scale_inv."""
    device = torch.device("cuda")
    history, scale = torch.zeros(16, device=device), torch.ones((), device=device)
    ref_history, ref_scale = history.clone(), scale.clone()
    gen = torch.Generator(device="cpu").manual_seed(7)
    for step in range(40):
        rows = int(torch.randint(64, 4096, (), generator=gen)) * 4
        x = torch.randn(rows, 1024, generator=gen).to(device, torch.bfloat16)
        x.view(-1)[int(torch.randint(0, x.numel(), (), generator=gen))] = 50.0 * (1 + step % 7)
        out = rowcol.delayed_scaling_step_rowcol(x, scale, history, *E4M3, 0, algo)
        ref = cast.delayed_scaling_step(x, ref_scale, ref_history, *E4M3, 0, algo)
        for name, a, b in zip(("data", "history", "scale", "scale_inv"), (out[0], *out[2:]), ref):
            _assert_same(a, b, f"step {step} ({rows} rows) {name}")
        _, _, history, scale, _ = out
        _, ref_history, ref_scale, _ = ref


def test_fp8_row_gather_writes_both_layouts(device, rowcol):
    """gather_rows_fp8: the rows of index_select (the rows zero_rows zeroed) and their transpose, the same bytes,
    for row counts on and off the program's 64-row tile and columns off its 128; an index of a row count off
    whole words, 1-D data or an empty index: UnsupportedLayout (the caller then gathers and transposes)."""
    gen = torch.Generator().manual_seed(3)
    for sources, rows, cols in ((40, 72, 64), (130, 260, 200), (7, 4, 16)):
        data = torch.randint(0, 256, (sources, cols), generator=gen, dtype=torch.uint8).to(device)
        index = torch.randint(0, sources, (rows,), generator=gen).to(device)
        zero_rows = torch.tensor([0, rows - 1, rows // 2]).to(device)
        want = data.index_select(0, index).index_fill_(0, zero_rows, 0)
        got, got_t = rowcol.gather_rows_fp8(data, index, zero_rows)
        _assert_same(got, want, f"{rows}x{cols} rows")
        _assert_same(got_t, _t(want), f"{rows}x{cols} transposed rows")
        got, got_t = rowcol.gather_rows_fp8(data.view(torch.float8_e4m3fn), index)
        _assert_same(got.view(torch.uint8), data.index_select(0, index), f"{rows}x{cols} rows, no zero rows")
        _assert_same(got_t.view(torch.uint8), _t(data.index_select(0, index)), f"{rows}x{cols} transposed")
    data = torch.zeros(8, 16, dtype=torch.uint8, device=device)
    for bad_data, bad_index in ((data, torch.arange(6)), (data.view(-1), torch.arange(8)), (data, torch.arange(0))):
        with pytest.raises(rowcol.UnsupportedLayout, match="a multiple of 4 rows"):
            rowcol.gather_rows_fp8(bad_data, bad_index.to(device))


def test_fp8_row_gather_is_on_by_default_and_cuda_only(policy):
    """fp8_gather_transposed is on (the GPU test of tests/moe/test_row_gather.py runs it against the switch off);
    CPU data gathers then transposes, the fused casts forced on or not."""
    data, index = torch.zeros(8, 16, dtype=torch.uint8), torch.arange(8)
    assert settings.current().fp8_gather_transposed is True
    assert policy.gather_rows_fp8(data, index) is None
    with settings.override(fused_casts=True):
        assert policy.gather_rows_fp8(data, index) is None


def test_per_tensor_transposed_data_needs_rows_in_words(device, rowcol):
    """Rows not a multiple of 4 (one word of four FP8 bytes), a 1-D or an empty x: UnsupportedLayout, so
    the quantizer takes the plain cast and transposes."""
    for shape in ((6, 64), (2, 6, 64), (64,), (0, 64)):
        with pytest.raises(rowcol.UnsupportedLayout):
            rowcol.current_scaling_quantize_rowcol(torch.ones(shape, device=device), *E4M3, False)


def test_one_pass_cast_is_on_by_default_and_checks_its_input():
    """On by default, but a CPU tensor or a shape off the tile does not take it (nothing is built); the
    kernel's own entry refuses bad input before any launch, naming what it takes."""
    from te_dist.quantization import cuda_rowcol

    x = torch.ones(64, 128, dtype=torch.bfloat16)
    assert settings.current().cuda_rowcol_cast is True
    with settings.override(cuda_rowcol_cast=False):
        assert not cuda_rowcol.enabled_for(x, torch.float8_e4m3fn)
    with settings.override(cuda_rowcol_cast=True):
        assert not cuda_rowcol.enabled_for(x, torch.float8_e4m3fn)  # a CPU tensor
    assert not cuda_rowcol._LIBRARY.tried  # never built
    with pytest.raises(ValueError, match=r"R % 64 == 0 and C % 128 == 0.*received \(64, 128\) torch.bfloat16 on cpu"):
        cuda_rowcol.cast_rowcol(x, torch.ones(1), torch.float8_e4m3fn, 448.0)


def test_nvcc_compiles_the_one_pass_cast_and_its_phases_run_on_the_host(tmp_path, monkeypatch):
    """cast_rowcol.cu (plain CUDA) compiles for sm_90a into the kernel cache and exports its C ABI; its
    per-thread phases, run on the host, write the reference's bytes."""
    import subprocess

    from cutlass_kernels import build
    from te_dist.quantization import cuda_rowcol

    if build.find_nvcc() is None:
        pytest.skip("nvcc is absent on this machine (the .cu build check needs the CUDA compiler)")

    monkeypatch.setenv("TE_DIST_CACHE", str(tmp_path))
    path = build.build_plain_source(cuda_rowcol.SOURCE)
    assert path.parent == tmp_path and path.name.startswith("cast_rowcol-")
    symbols = subprocess.run(["nm", "-D", str(path)], capture_output=True, text=True, check=True).stdout
    for name in ("te_cr_cast", "te_cr_cast_on_host", "te_cr_last_error"):
        assert f" T {name}" in symbols, f"{name} is not exported by {path.name}"
    # The kernel's own phases (cast_patch, store_transposed), run on the host: the same bytes as the
    # plain cast and its transpose, amax bits merged, over several tiles and matrices.
    lib = cuda_rowcol._Library(path)
    for seed, (shape, (fp8_dtype, fmt_max)) in enumerate((((2, 128, 256), E4M3), ((3, 64, 384), E5M2))):
        x = _data(shape, torch.bfloat16, "cpu", seed=seed)
        bits = torch.tensor([7], dtype=torch.int32)
        data, data_t = lib.cast_on_host(x, 0.37, fp8_dtype, fmt_max, bits)
        ref = cast.cast_fp8_per_tensor(x, torch.tensor(0.37), fp8_dtype, fmt_max)
        _assert_same(data, ref, f"{shape} data")
        _assert_same(data_t, _t(ref), f"{shape} data_t")
        assert bits.item() == x.float().abs().view(torch.int32).max().item()
    with pytest.raises(ValueError, match="on the tile"):
        lib.cast_on_host(torch.ones(64, 100, dtype=torch.bfloat16), 1.0, *E4M3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON or not torch.cuda.is_available(), reason="needs triton and a CUDA GPU")
def test_one_pass_cast_matches_the_two_pass_cast_on_large_stacks(rowcol):
    """The CUDA kernel itself on many blocks: a grouped weight stack [E, N, K] (bf16), current and delayed
    scaling, byte for byte the two-pass path's output, and the quantizer's weight copy alike."""
    from te_dist.quantization import cuda_rowcol

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 1024, 768, generator=gen) * 4).to("cuda", torch.bfloat16)
    x[3, 17, 5] = 300.0
    history, scale = torch.zeros(8, device="cuda"), torch.full((), 2.0, device="cuda")
    runs = {}
    for on in (False, True):
        with settings.override(cuda_rowcol_cast=on):
            assert cuda_rowcol.enabled_for(x, E4M3[0]) == on
            runs[on] = (rowcol.current_scaling_quantize_rowcol(x, *E4M3, False)
                        + rowcol.delayed_scaling_step_rowcol(x, scale, history, *E4M3, 0, "max"))
    for i, (a, b) in enumerate(zip(runs[True], runs[False])):
        _assert_same(a, b, f"output {i}")


# ----------------------------------------------------------------------------- block formats
def _reference_blocks(x, block, fmt, power_2, columnwise):
    src = x.transpose(-1, -2) if columnwise else x
    return cast.cast_fp8_blocks(src, *block, *fmt, power_2)


# (shape, rowwise, columnwise): rows 40 / 200 are not multiples of the 64-row rowwise tile
_BLOCK_1x128_CASES = [((40, 256), True, False), ((200, 384), True, False), ((2, 3, 128), True, False),
                      ((128, 384), True, True), ((256, 128), False, True), ((2, 128, 256), True, True)]
_BLOCK_128_CASES = [((128, 256), True, False), ((256, 384), True, True), ((384, 128), False, True),
                    ((2, 128, 256), True, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("power_2", [False, True], ids=["fp32", "pow2"])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
def test_float8_blocks(device, kernels, dtype, fmt, power_2, block):
    cases = _BLOCK_1x128_CASES if block == (1, 128) else _BLOCK_128_CASES
    for seed, (shape, rowwise, columnwise) in enumerate(cases):
        x = _data(shape, dtype, device, seed=seed)
        row_data, row_s, col_data, col_s = kernels.cast_fp8_blocks(
            x, *block, *fmt, power_2, rowwise=rowwise, columnwise=columnwise)
        for wanted, data, scale, transposed, name in ((rowwise, row_data, row_s, False, "row"),
                                                      (columnwise, col_data, col_s, True, "col")):
            if wanted:
                ref_data, ref_s = _reference_blocks(x, block, fmt, power_2, transposed)
                _assert_same(data, ref_data, f"{shape} {name} data")
                _assert_same(scale, ref_s, f"{shape} {name} scale_inv")
            else:
                assert data is None and scale is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(128, 384), (640, 256), (256, 128)])
@pytest.mark.parametrize("rowwise", [True, False], ids=["row+col", "col"])
def test_float8_1x128_columnwise_scales_in_the_wgrad_layout(device, kernels, dtype, shape, rowwise):
    """col_scales_t: the columnwise scales M-major, [rows/128 + 1, cols], the last row zeros (the FP8
    wgrad kernel's layout), the data and the rowwise copy as without it."""
    x = _data(shape, dtype, device, seed=sum(shape))
    row_data, row_s, col_data, scale_t = kernels.cast_fp8_blocks(x, 1, 128, *E4M3, True, rowwise=rowwise,
                                                                 columnwise=True, col_scales_t=True)
    ref_data, ref_s = _reference_blocks(x, (1, 128), E4M3, True, True)
    _assert_same(col_data, ref_data, "col data")
    assert scale_t.shape == (shape[0] // 128 + 1, shape[1])
    _assert_same(scale_t[:-1], ref_s.t().contiguous(), "M-major col scales")
    _assert_same(scale_t[-1], torch.zeros(shape[1], device=device), "zero row")
    if rowwise:
        ref_row, ref_row_s = _reference_blocks(x, (1, 128), E4M3, True, False)
        _assert_same(row_data, ref_row, "row data")
        _assert_same(row_s, ref_row_s, "row scales")
    with pytest.raises(ValueError, match="2-D"):
        kernels.cast_fp8_blocks(x.reshape(1, *shape), 1, 128, *E4M3, True, columnwise=True, col_scales_t=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rowwise", [True, False], ids=["row+col", "col"])
def test_float8_1x128_gathered_rows_equal_the_cast_of_their_copy(device, kernels, dtype, rowwise):
    """gather=idx: the copies of rows idx of x (a negative index: a zero row), read through the index,
    == the cast of the gathered copy, bit for bit (rows repeated, skipped and zero, as the MoE expand)."""
    x = _data((200, 384), dtype, device, seed=7)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 200, (384,), generator=g)
    idx[torch.tensor([5, 127, 128, 300, 383])] = -1
    copy = x.index_select(0, idx.clamp_min(0).to(device))
    copy[(idx < 0).to(device)] = 0
    idx = idx.to(device)
    got = kernels.cast_fp8_blocks(x, 1, 128, *E4M3, True, rowwise=rowwise, columnwise=True, col_scales_t=True,
                                  gather=idx)
    want = kernels.cast_fp8_blocks(copy, 1, 128, *E4M3, True, rowwise=rowwise, columnwise=True, col_scales_t=True)
    for a, b, what in zip(got, want, ("row data", "row scales", "col data", "M-major col scales")):
        if b is None:
            assert a is None, what
        else:
            _assert_same(a, b, what)
    with pytest.raises(kernels.UnsupportedLayout, match="tile kernel"):
        kernels.cast_fp8_blocks(x, 1, 128, *E4M3, True, rowwise=True, columnwise=False, gather=idx)
    with pytest.raises(kernels.UnsupportedLayout, match="1x128 blocks"):
        kernels.cast_fp8_blocks(x[:, :256], 128, 128, *E4M3, True, columnwise=True, gather=idx[:256])


# rows 96: a multiple of the 32-element MX block but not of the 64-row row+col tile
_MX_CASES = [((40, 96), True, False), ((96, 160), True, True), ((96, 64), False, True), ((2, 64, 96), True, True),
             ((1, 32), True, False)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", [(E4M3, 8), (E5M2, 15)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("margin", [0, 2])
def test_mxfp8(device, kernels, dtype, fmt, margin):
    (fp8, fmt_max), emax = fmt
    for seed, (shape, rowwise, columnwise) in enumerate(_MX_CASES):
        x = _data(shape, dtype, device, seed=seed)
        row_data, row_codes, col_data, col_codes = kernels.cast_mxfp8(
            x, fp8, fmt_max, emax, margin, rowwise=rowwise, columnwise=columnwise)
        for wanted, data, codes, src in ((rowwise, row_data, row_codes, x),
                                         (columnwise, col_data, col_codes, x.transpose(-1, -2))):
            if not wanted:
                assert data is None and codes is None
                continue
            ref_data, ref_codes = cast.cast_mxfp8(src, 32, fp8, fmt_max, emax, margin)
            _assert_same(data, ref_data, f"{shape} data")
            assert torch.equal(codes.cpu(), ref_codes.cpu()), f"{shape} E8M0 codes differ"


def test_mxfp8_exponent_edges(device, kernels):
    """Blocks whose amax sits at the exponent clamps: zero, smallest subnormal, fp32 max, NaN, Inf."""
    x = torch.ones(6, 32, device=device)
    x[0] = 0.0
    x[1] = 2.0**-149
    x[2, 3] = torch.finfo(torch.float32).max
    x[3, 4] = float("nan")
    x[4, 5] = -float("inf")
    x[5] = 2.0**-126 * 3
    for fp8, fmt_max, emax in ((*E4M3, 8), (*E5M2, 15)):
        for margin in (0, 3):
            data, codes, _, _ = kernels.cast_mxfp8(x, fp8, fmt_max, emax, margin)
            ref_data, ref_codes = cast.cast_mxfp8(x, 32, fp8, fmt_max, emax, margin)
            _assert_same(data, ref_data, "data")
            assert torch.equal(codes.cpu(), ref_codes.cpu())


# ----------------------------------------------------------------------------- NVFP4 (rowwise copy)
_NVFP4_CASES = {1: [(40, 64), (3, 5, 32), (1, 16), (300, 160)], 16: [(32, 48), (2, 16, 64), (48, 272)]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_rows", [1, 16], ids=["1x16", "16x16"])
def test_nvfp4_round_to_nearest(device, nvfp4_kernels, dtype, block_rows):
    from te_dist.quantization.scaling import compute_amax, nvfp4_global_scale

    for seed, shape in enumerate(_NVFP4_CASES[block_rows]):
        for specials in (False, True):
            x = _data(shape, dtype, device, seed=seed, specials=specials)
            packed, scales, s_inv = nvfp4_kernels.cast_nvfp4(x, block_rows, False)
            s_enc = nvfp4_global_scale(compute_amax(x))
            ref_packed, ref_scales = cast.cast_nvfp4(x, block_rows, 16, s_enc)
            _assert_same(packed, ref_packed, f"{shape} packed")
            _assert_same(scales, ref_scales, f"{shape} scales")
            _assert_same(s_inv, 1.0 / s_enc, f"{shape} global_scale_inv")


@pytest.mark.parametrize("block_rows", [1, 16], ids=["1x16", "16x16"])
def test_nvfp4_products_that_round_onto_a_tie(device, nvfp4_kernels, block_rows):
    """Elements whose float32 product ``|x| * factor`` lands exactly on a rounding tie of the E2M1
    grid (0.25, 0.75, ..., 5) while the exact product is just off it: the cast must round the
    float32 product, as the reference does. An fma contracted from the multiply and the rounding
    add would round the exact product and pick the other neighbour."""
    from te_dist.quantization.scaling import compute_amax, nvfp4_block_scales, nvfp4_global_scale

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    amax = 3.0 * 1.037 ** torch.arange(64, dtype=torch.float32)  # one per block: 64 different factors
    s_enc = nvfp4_global_scale(amax.max())
    factor = nvfp4_block_scales(amax, s_enc)[1]
    ulps = torch.arange(-3, 4, dtype=torch.int32)
    x = torch.zeros(64, 16)
    x[:, 0] = amax
    for r in range(64):  # block r: the tie r % 7 divided by the factor, give or take 3 ulps, both signs
        near = (ties[r % 7] / factor[r].double()).float().view(torch.int32) + ulps
        x[r, 1:8], x[r, 8:15] = near.view(torch.float32), -near.view(torch.float32)
    exact = x.double().abs() * factor.double()[:, None]  # exact: float32 x float32 fits in float64
    rounded = exact.float().double()
    onto_tie = torch.isin(rounded, ties) & (exact != rounded)
    assert onto_tie.sum() >= 20, "the crafted data must hold products that round onto a tie"
    if block_rows == 16:  # tile b = 16 copies of block b's row: the same amax, so the same factor
        x = x.reshape(1, -1).expand(16, -1).contiguous()
    x = x.to(device)
    packed, scales, _ = nvfp4_kernels.cast_nvfp4(x, block_rows, False)
    ref_packed, ref_scales = cast.cast_nvfp4(x, block_rows, 16, nvfp4_global_scale(compute_amax(x)))
    _assert_same(scales, ref_scales, "scales")
    _assert_same(packed, ref_packed, "packed")


@pytest.mark.parametrize("block_rows", [1, 16], ids=["1x16", "16x16"])
def test_nvfp4_stochastic_rounding(device, nvfp4_kernels, block_rows):
    """Every element lands on one of its two neighbours on the E2M1 grid (the same scales as round
    to nearest), the rounding is unbiased on average, and torch.manual_seed reproduces it."""
    from te_dist.quantization.e2m1 import e2m1_codes_to_float, unpack_e2m1
    from te_dist.quantization.scaling import compute_amax, nvfp4_global_scale

    x = _data((64, 128), torch.float32, device, seed=3, specials=False)
    torch.manual_seed(5)
    packed, scales, s_inv = nvfp4_kernels.cast_nvfp4(x, block_rows, True)
    torch.manual_seed(5)
    again = nvfp4_kernels.cast_nvfp4(x, block_rows, True)[0]
    assert torch.equal(packed, again)
    rn_packed, rn_scales, _ = nvfp4_kernels.cast_nvfp4(x, block_rows, False)
    _assert_same(scales, rn_scales, "SR scales == RN scales")
    # the reference with noise 0 always rounds up, with noise just below 1 (almost) always down
    s_enc = nvfp4_global_scale(compute_amax(x))
    up = cast.cast_nvfp4(x, block_rows, 16, s_enc, torch.zeros(x.shape, device=device), True)[0]
    down = cast.cast_nvfp4(x, block_rows, 16, s_enc, torch.full(x.shape, 1.0 - 2.0**-24, device=device), True)[0]
    nib = unpack_e2m1(packed)
    assert ((nib == unpack_e2m1(up)) | (nib == unpack_e2m1(down))).all(), "SR left the two neighbouring grid points"
    assert not torch.equal(packed, down) and not torch.equal(packed, up)
    expand = scales.float().repeat_interleave(block_rows, 0).repeat_interleave(16, 1) * s_inv
    samples = torch.stack([e2m1_codes_to_float(unpack_e2m1(nvfp4_kernels.cast_nvfp4(x, block_rows, True)[0])) * expand
                           for _ in range(200)])
    mean_err = (samples.mean(0) - x).abs().mean().item()
    rn_err = (e2m1_codes_to_float(unpack_e2m1(rn_packed)) * expand - x).abs().mean().item()
    assert mean_err < rn_err / 4


def test_empty_inputs(device, kernels, nvfp4_kernels):
    """Zero rows (an expert without tokens): empty outputs, per-tensor scale from amax 0 (fallback 1.0)."""
    x = torch.zeros(0, 128, device=device, dtype=torch.bfloat16)
    data, scale_inv = kernels.current_scaling_quantize(x, *E4M3, False)
    assert data.shape == (0, 128) and scale_inv.item() == 1.0
    history, scale = torch.full((3,), 2.0, device=device), torch.tensor(4.0, device=device)
    out = kernels.delayed_scaling_step(x, scale, history, *E4M3, 0, "max")
    ref = cast.delayed_scaling_step(x, scale, history, *E4M3, 0, "max")
    for a, b in zip(out, ref):
        _assert_same(a, b, "delayed, empty x")
    for block in ((1, 128), (128, 128)):
        row_data, row_s, col_data, col_s = kernels.cast_fp8_blocks(x, *block, *E4M3, True, rowwise=True,
                                                                   columnwise=True)
        assert row_data.shape == (0, 128) and col_data.shape == (128, 0)
        assert row_s.shape[0] == 0 and col_s.shape[-1] == 0
    row_data, row_codes, _, _ = kernels.cast_mxfp8(x, *E4M3, 8, 0)
    assert row_data.shape == (0, 128) and row_codes.shape == (0, 4)
    packed, scales, s_inv = nvfp4_kernels.cast_nvfp4(x, 16, False)
    assert packed.shape == (0, 64) and scales.shape == (0, 8) and s_inv.item() == 1.0


# ----------------------------------------------------------------------------- through the quantizers
_QUANTIZER_CASES = [
    (lambda: R.DelayedScaling(amax_history_len=3, margin=1), "input"),
    (lambda: R.DelayedScaling(amax_compute_algo="most_recent"), "grad_output"),
    (lambda: R.DelayedScaling(amax_compute_algo=lambda h: h[:2].amax()), "input"),  # cast+amax pass, torch update
    (lambda: R.Float8CurrentScaling(), "input"),
    (lambda: R.Float8CurrentScaling(use_power_2_scales=True), "grad_output"),
    (lambda: R.Float8BlockScaling(), "input"),
    (lambda: R.Float8BlockScaling(use_power_2_scales=False), "weight"),
    (lambda: R.Float8BlockScaling(fp8_format=R.Format.HYBRID), "grad_output"),
    (lambda: R.MXFP8BlockScaling(), "input"),
    (lambda: R.MXFP8BlockScaling(fp8_format=R.Format.E5M2, margin=1), "weight"),
    (lambda: R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True), "input"),
    (lambda: R.NVFP4BlockScaling(), "weight"),  # 16x16 blocks
]


def _flatten(q):
    if hasattr(q, "data"):
        return [q.data, q.scale_inv]
    out = []
    for copy in (q.rowwise, q.columnwise):
        out += [] if copy is None else [copy.data, copy.scale_inv]
    return out


@pytest.mark.parametrize("case", range(len(_QUANTIZER_CASES)))
def test_quantizers_fused_equal_reference(device, reference_mode, case):
    build, role = _QUANTIZER_CASES[case]
    recipe = build()
    fused_q, ref_q = make_quantizer(recipe, role), make_quantizer(recipe, role)
    x3 = _data((2, 128, 256), torch.bfloat16, device, seed=case, specials=False)
    inputs = [x3, x3[1].t(), x3 * 4]  # 3-D, non-contiguous (transposed view), rescaled
    for step, x in enumerate(inputs):
        for rowwise, columnwise in ((True, False), (True, True), (False, True)):
            with settings.override(fused_casts=True):  # forced: a kernel failure raises instead of falling back
                got = fused_q(x, rowwise=rowwise, columnwise=columnwise)
            with settings.override(fused_casts=False):
                want = ref_q(x, rowwise=rowwise, columnwise=columnwise)
            for i, (a, b) in enumerate(zip(_flatten(got), _flatten(want))):
                _assert_same(a, b, f"step {step} row={rowwise} col={columnwise} tensor {i}")
            _assert_same(got.dequantize(), want.dequantize(), "dequantize")
    if hasattr(fused_q, "amax_history"):
        _assert_same(fused_q.amax_history, ref_q.amax_history, "amax history")
        _assert_same(fused_q.scale, ref_q.scale, "scale")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_cuda_default_takes_the_fused_path(cuda_device, monkeypatch):
    """On an H200 the automatic mode (opt-in) must pick the kernels (no silent fallback to the compiled path)."""
    calls = []
    from te_dist.quantization import triton_casts

    real = triton_casts.cast_fp8_blocks
    monkeypatch.setattr(triton_casts, "cast_fp8_blocks", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(256, 256, device=cuda_device, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught, settings.override(fused_casts=None):
        warnings.simplefilter("always")
        make_quantizer(R.Float8BlockScaling(), "input")(x, columnwise=True)
    assert calls == [1]
    fallbacks = [str(w.message) for w in caught if "fused Triton cast" in str(w.message)]
    assert not fallbacks, fallbacks  # the kernel ran, it did not fail over to the compiled path


# ----------------------------------------------------------------------------- sm_90 build check (no GPU needed)
def _compile_configs(tc):
    """(kernel, pointer/int signature, constexprs, num_warps) for every launch the wrappers make."""
    for inp, (f8, fmax, emax) in [("*bf16", ("*fp8e4nv", 448.0, 8)), ("*bf16", ("*fp8e5", 57344.0, 15)),
                                  ("*fp32", ("*fp8e4nv", 448.0, 8))]:
        pt = dict(BLOCK=tc._PT_BLOCK, ITERS=tc._PT_ITERS)
        yield tc._amax_kernel, {"x_ptr": inp, "amax_ptr": "*i32", "n": "i32"}, pt, tc._PT_WARPS
        # (SCALE_FROM_AMAX, RECORD_AMAX, POWER_2, UPDATE, ALGO_MAX): current scaling, cast_and_amax, delayed
        for from_amax, record, power_2, update, algo_max in [(True, False, False, False, False),
                                                             (True, False, True, False, False),
                                                             (False, True, False, False, False),
                                                             (False, True, False, True, True),
                                                             (False, True, False, True, False)]:
            hist = "*fp32" if update else "*i32"
            sig = {"x_ptr": inp, "out_ptr": f8, "scale_ptr": "*i32" if from_amax else "*fp32", "amax_ptr": "*i32",
                   "scale_inv_ptr": "*fp32" if from_amax else "*i32", "n": "i32", "hist_ptr": hist,
                   "new_hist_ptr": hist, "new_scale_ptr": hist, "new_scale_inv_ptr": hist, "hist_len": "i32",
                   "margin_mul": "fp32"}
            yield tc._cast_per_tensor_kernel, sig, dict(
                FMT_MAX=fmax, SCALE_FROM_AMAX=from_amax, POWER_2=power_2, RECORD_AMAX=record, REVERSE=from_amax,
                UPDATE=update, ALGO_MAX=algo_max, HIST_BLOCK=1024 if update else 16, HIST_ITERS=int(update),
                **pt), tc._PT_WARPS
        for mx, group in ((False, 128), (True, 32)):
            sdt = "*u8" if mx else "*fp32"
            consts = dict(FMT_MAX=fmax, POWER_2=not mx, MX=mx, EMAX=emax, MARGIN=0, G=group)
            nb, iters, warps = tc._ROWS_TILE[group]
            yield tc._cast_rows_kernel, {"x_ptr": inp, "out_ptr": f8, "s_ptr": sdt, "nblocks": "i32"}, dict(
                NB=nb, ITERS=iters, **consts), warps
            ng, sub, warps = tc._TILE[(group, False)]
            for gather in (False,) if mx else (False, True):  # only 1x128 casts read rows through an index
                sig = {"x_ptr": inp, "idx_ptr": "*i64" if gather else inp, "row_ptr": f8, "row_s_ptr": sdt,
                       "col_ptr": f8, "col_s_ptr": sdt, "R": "i32", "C": "i32"}
                for row, col_t in ((True, False), (False, False), (True, not mx), (False, not mx)):
                    yield tc._cast_tile_kernel, sig, dict(NG=ng, SUB=sub, ROW=row, COL=True, SQUARE=False, COL_T=col_t,
                                                          GATHER=gather, **consts), warps
        from te_dist.quantization import triton_nvfp4 as nv
        from te_dist.quantization import triton_rowcol as rc

        for power_2 in (False, True):  # the one-pass cast's scale, and its delayed history roll
            yield rc._scale_kernel, {"amax_ptr": "*i32", "scale_ptr": "*fp32", "scale_inv_ptr": "*fp32"}, dict(
                FMT_MAX=fmax, POWER_2=power_2), 1
        for algo_max in (False, True):
            sig = {"amax_ptr": "*i32", "hist_ptr": "*fp32", "scale_ptr": "*fp32", "new_hist_ptr": "*fp32",
                   "new_scale_ptr": "*fp32", "new_scale_inv_ptr": "*fp32", "hist_len": "i32", "margin_mul": "fp32"}
            yield rc._roll_history_kernel, sig, dict(FMT_MAX=fmax, ALGO_MAX=algo_max, BLOCK=1024, ITERS=1), 1
        tr, tcols, warps = tc._PT_TILE
        for gather in (False, True):  # the byte transpose, and the row gather writing both layouts
            sig = {"src_ptr": "*u8", "dst_ptr": "*u8", "idx_ptr": "*i64", "rows_ptr": "*u8", "R": "i32", "C": "i32"}
            yield rc._transpose_bytes_kernel, sig, dict(TR=tr, TC=tcols, GATHER=gather), warps
        for sr in (False, True):
            nb, iters, warps = nv._NVFP4_ROWS
            sig = {"x_ptr": inp, "out_ptr": "*i32", "s_ptr": "*u8", "amax_ptr": "*i32", "s_inv_ptr": "*fp32",
                   "nblocks": "i32", "seed": "i32"}
            yield nv._cast_nvfp4_rows_kernel, sig, dict(NB=nb, ITERS=iters, SR=sr), warps
            ng, warps = nv._NVFP4_2D
            sig = {"x_ptr": inp, "out_ptr": "*i32", "s_ptr": "*u8", "tiles_ptr": "*fp32", "amax_ptr": "*i32",
                   "s_inv_ptr": "*fp32", "C": "i32", "seed": "i32"}
            yield nv._cast_nvfp4_2d_kernel, sig, dict(NG=ng, SR=sr), warps
        ng, warps = nv._amax_tile(torch.float32 if inp == "*fp32" else torch.bfloat16)
        sig = {"x_ptr": inp, "tiles_ptr": "*fp32", "amax_ptr": "*i32", "C": "i32"}
        yield nv._tile_amax_kernel, sig, dict(NG=ng), warps
        sig = {"x_ptr": inp, "idx_ptr": inp, "row_ptr": f8, "row_s_ptr": "*fp32", "col_ptr": f8,
               "col_s_ptr": "*fp32", "R": "i32", "C": "i32"}
        ng, sub, warps = tc._TILE[(128, True)]
        for row, col in ((True, False), (True, True), (False, True)):
            yield tc._cast_tile_kernel, sig, dict(FMT_MAX=fmax, POWER_2=True, MX=False, EMAX=0, MARGIN=0, G=128, NG=ng,
                                                  SUB=sub, ROW=row, COL=col, SQUARE=True, COL_T=False,
                                                  GATHER=False), warps


@pytest.mark.skipif(not HAS_TRITON or INTERPRET or torch.cuda.is_available(),
                    reason="CPU-side build check: needs triton without TRITON_INTERPRET (GPU hosts run the kernels)")
def test_kernels_build_for_sm90_without_spills(monkeypatch):
    """Every kernel configuration compiles to an sm_90a cubin with this Triton, with hardware FP8 casts, no
    flush-to-zero or approximate arithmetic (subnormal scales must survive), and no register spills (a
    spill would cost bandwidth). Integer args are marked divisible by 16, as Triton's
    launcher specialises them for the aligned shapes the quantizers see."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from te_dist.quantization import triton_casts as tc
    from te_dist.quantization import triton_nvfp4 as nv

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for kernel, sig, consts, warps in _compile_configs(tc):
        names = kernel.arg_names
        full = {**sig, **{k: "constexpr" for k in consts}}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a in sig and a != "margin_mul"}
        src = ASTSource(kernel, {a: full[a] for a in names}, consts, attrs=attrs)
        options = {"num_warps": warps, **(nv._OPTIONS if kernel.fn.__module__ == nv.__name__ else {})}
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        where = f"{kernel.fn.__name__} {sig.get('x_ptr', '')} {consts}"
        ptx = compiled.asm["ptx"]
        if "row_ptr" in sig or sig.get("out_ptr", "*u8") != "*u8" or "nvfp4" in kernel.fn.__name__:
            assert "cvt.rn.satfinite.e" in ptx, f"{where}: no hardware FP8 conversion"
        inexact = [line.strip() for line in ptx.splitlines() if ".ftz" in line or ".approx" in line or "div.full" in line]
        assert not inexact, f"{where}: flush-to-zero / approximate ops break bit-exactness: {inexact[:3]}"
        if os.path.exists(cuobjdump):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
            assert "STACK:0 " in usage and "LOCAL:0 " in usage, f"{where}: spills ({usage.strip()})"


# ----------------------------------------------------------------------------- policy (no Triton needed)
@pytest.fixture
def policy():
    before = settings.current().fused_casts
    yield fused
    settings.set_for_process(fused_casts=before)  # what the older setter changed, back as it was
    fused._failed.clear()


def test_switch_rejects_non_bool(policy):
    with pytest.raises(TypeError, match="None, True or False"):
        set_fused_casts_enabled("yes")


def test_without_triton_auto_falls_back_and_forcing_raises(policy, monkeypatch):
    monkeypatch.setattr(fused, "_load", lambda family="fp8": (None, "ModuleNotFoundError('triton')"))
    assert not fused.fused_casts_available()
    set_fused_casts_enabled(None)
    with pytest.raises(RuntimeError, match="needs triton"):
        set_fused_casts_enabled(True)
    assert fused.fused_casts_enabled() is None  # the failed call left the setting alone
    # automatic mode: CPU tensors never take the fused path, and quantizers keep working
    x = torch.randn(4, 128)
    assert fused.fused_casts_for(x) is None
    q = make_quantizer(R.Float8BlockScaling(), "input")(x)
    assert q.rowwise.data.shape == (4, 128)


def test_forced_on_cpu_without_interpreter_raises(policy, monkeypatch):
    monkeypatch.setattr(fused, "_load", lambda family="fp8": (object(), ""))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    set_fused_casts_enabled(True)
    assert settings.source("fused_casts") == "te_dist.settings.fused_casts=True"
    with pytest.raises(ValueError, match=r"forced on \(te_dist.settings.fused_casts=True\).*TRITON_INTERPRET=1"):
        fused.fused_casts_for(torch.randn(4, 128))
    assert fused.fused_casts_for(torch.randn(4, 128, dtype=torch.float64)) is None  # float64: reference path
    set_fused_casts_enabled(False)
    assert fused.fused_casts_for(torch.randn(4, 128)) is None


def test_forced_by_the_setting_without_triton_raises_at_the_cast(policy, monkeypatch):
    """The setting accepts True without looking for Triton (it imports nothing); the first cast that
    would take the fused path then names the setting and the import error."""
    monkeypatch.setattr(fused, "_load", lambda family="fp8": (None, "ModuleNotFoundError('triton')"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with settings.override(fused_casts=True):
        with pytest.raises(RuntimeError, match=r"forced on \(te_dist.settings.fused_casts=True\) but their kernels "
                                               r"do not import: ModuleNotFoundError"):
            fused.fused_casts_for(torch.randn(4, 128))


def test_run_fused_failure_warns_once_then_falls_back(policy):
    calls = []

    def broken(x):
        calls.append(x)
        raise RuntimeError("triton build failed")

    with pytest.warns(UserWarning, match="using the compiled cast instead"):
        assert fused.run_fused(("k", 1), broken, 1) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused.run_fused(("k", 1), broken, 2) is None  # remembered: no second attempt, no warning
    assert calls == [1]
    assert fused.run_fused(("k", 2), lambda x: x + 1, 1) == 2


def test_run_fused_forced_mode_raises(policy, monkeypatch):
    monkeypatch.setattr(fused, "_load", lambda family="fp8": (object(), ""))
    with settings.override(fused_casts=True), pytest.raises(RuntimeError, match="build failed"):
        fused.run_fused(("k",), lambda: (_ for _ in ()).throw(RuntimeError("build failed")))
