"""The 1x128 block cast in CUDA (cast_blocks.cu, ``te_dist.settings.cuda_block_cast``): both
copies of an activation or gradient from one read, gathered rows too, bit for bit the reference cast.

CPU: nvcc builds the kernel and its four phases run on the host (tiles, shared-memory reductions, scales,
layouts, the gather); the launch ids (``cuda_block_cast_launch``) checked before any device call. GPU (``-m gpu``):
the kernel itself under every launch against the Triton tile cast on large inputs, and the block quantizer's
copies with the switch on and off."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from te_dist import recipe as R
from te_dist import settings
from te_dist.quantization import cast, cuda_blocks, make_quantizer

E4M3 = (torch.float8_e4m3fn, 448.0)
E5M2 = (torch.float8_e5m2, 57344.0)
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _values(rows: int, cols: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Values over many magnitudes, plus a zero block, NaN, +-Inf and a subnormal where the shape has room."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 12, (rows, cols), generator=g).float())
    x[1, :128] = 0.0  # an all-zero 1x128 block
    x[2, 5], x[3, 100], x[4, 7] = float("nan"), float("inf"), -float("inf")
    x[5, 9] = torch.finfo(dtype).smallest_normal / 8
    return x.to(dtype)


def _same(actual, expected, what: str) -> None:
    """Bitwise equality, NaN equal to NaN."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
    a_nan, e_nan = torch.isnan(actual.float()).cpu(), torch.isnan(expected.float()).cpu()
    assert torch.equal(a_nan, e_nan), f"{what}: NaN positions differ"
    ints = {1: torch.uint8, 4: torch.int32}[actual.element_size()]
    diff = (actual.view(ints).cpu() != expected.view(ints).cpu()) & ~a_nan
    assert not diff.any(), f"{what}: {int(diff.sum())} elements differ, first at {diff.nonzero()[0].tolist()}"


def _reference(x, fmt, power_2: bool, rowwise: bool, col_scales_t: bool, gather=None):
    """(row data, row scales, col data, col scales) of cast.cast_fp8_blocks on the (gathered) rows."""
    if gather is not None:
        x = x.index_select(0, gather.clamp_min(0))
        x[gather < 0] = 0
    row = cast.cast_fp8_blocks(x, 1, 128, *fmt, power_2) if rowwise else (None, None)
    col_data, col_s = cast.cast_fp8_blocks(x.t().contiguous(), 1, 128, *fmt, power_2)
    if col_scales_t:
        col_s = torch.cat((col_s.t(), torch.zeros(1, x.shape[1], dtype=col_s.dtype, device=col_s.device)))
    return (*row, col_data, col_s)


def _check(got, want, what: str) -> None:
    for a, b, name in zip(got, want, ("row data", "row scales", "col data", "col scales")):
        if b is None:
            assert a is None, f"{what}: {name} written though not asked for"
        else:
            _same(a, b, f"{what}: {name}")


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    from cutlass_kernels import build

    if build.find_nvcc() is None:
        pytest.skip("nvcc is absent on this machine (the .cu build check needs the CUDA compiler)")
    cache = tmp_path_factory.mktemp("kcache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TE_DIST_CACHE", str(cache))
        path = build.build_plain_source(cuda_blocks.SOURCE)
    return cuda_blocks._Library(path)


# (rows, cols, rowwise, col_scales_t, gathered rows or 0): several tiles each way, one tile, gathers
_HOST_CASES = [(256, 384, True, False, 0), (128, 128, False, True, 0), (384, 256, True, True, 0),
               (200, 256, True, True, 256), (200, 128, False, False, 384)]


@pytest.mark.parametrize("launch", range(len(cuda_blocks.BLOCK_LAUNCHES)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("power_2", [False, True], ids=["fp32", "pow2"])
@pytest.mark.parametrize("case", _HOST_CASES, ids=lambda c: "x".join(map(str, c)))
def test_host_phases_write_the_reference_copies(host_lib, dtype, fmt, power_2, case, launch):
    """The kernel's phases, run on the host under each launch's amaxes and conversions: the reference's bytes and
    scales in every layout, rows read through a gather index (repeated, skipped, negative for a zero row) as the
    cast of their copy; NaN, +-Inf, a zero block and a subnormal among the values (the amax's ordering)."""
    rows, cols, rowwise, col_scales_t, gathered = case
    x = _values(rows, cols, seed=rows + cols, dtype=dtype)
    gather = None
    if gathered:
        gather = torch.randint(0, rows, (gathered,), generator=torch.Generator().manual_seed(gathered))
        gather[torch.tensor([0, 127, 128, gathered - 1])] = -1
    got = host_lib.blocks_on_host(x, *fmt, power_2, rowwise=rowwise, col_scales_t=col_scales_t, gather=gather,
                                  launch=launch)
    _check(got, _reference(x, fmt, power_2, rowwise, col_scales_t, gather), f"{case}")


@pytest.mark.parametrize("launch", range(len(cuda_blocks.BLOCK_LAUNCHES)))
def test_a_clamp_below_the_formats_largest_value_holds_under_every_launch(host_lib, launch):
    """fmt_max under E4M3's 448 (values clamped there, not at the format's saturation): the reference's bytes
    under every launch (the paired conversions saturate at 448 only, so launches 1 and 2 run as launch 0)."""
    x = _values(256, 256, seed=11)
    got = host_lib.blocks_on_host(x, torch.float8_e4m3fn, 240.0, False, col_scales_t=True, launch=launch)
    want = _reference(x, (torch.float8_e4m3fn, 240.0), False, True, True)
    _check(got, want, f"fmt_max 240 launch {launch}")
    values = got[0].float()
    assert float(values[~values.isnan()].abs().max()) == 240.0  # +-Inf's block: the clamp, not 448, bounds it


def test_the_switch_and_the_checks_before_any_launch():
    """On by default, and off with the switch; a CPU tensor, a shape off the 128 tile or a bad index never fits,
    and cast_blocks says what it takes and what it received before building or launching anything."""
    x = torch.ones(128, 256, dtype=torch.bfloat16)
    assert settings.current().cuda_block_cast is True
    assert not cuda_blocks.blocks_enabled_for(x, E4M3[0])  # a CPU tensor
    with settings.override(cuda_block_cast=False):
        assert not cuda_blocks.blocks_enabled_for(x, E4M3[0])
    assert not cuda_blocks.blocks_fit(x, E4M3[0], torch.zeros(128, dtype=torch.int32))  # not an int64 index
    assert not cuda_blocks.blocks_fit(torch.ones(100, 256, dtype=torch.bfloat16), E4M3[0])
    with pytest.raises(ValueError, match=r"multiples of 128.*received \(128, 256\) torch.bfloat16 on cpu"):
        cuda_blocks.cast_blocks(x, *E4M3, True)
    with pytest.raises(ValueError, match=r"takes a CPU x \[R, C\] of"):
        cuda_blocks._Library.blocks_on_host(None, x.float(), *E4M3, True)


def test_every_launch_is_one_the_library_knows_and_a_bad_one_is_refused_first(host_lib):
    """cuda_block_cast_launch: the ids of BLOCK_LAUNCHES are the library's (it refuses the next one, before any
    device call, naming the range), cast_blocks refuses a bad launch before anything else, and the setting
    parses 0 to the last id from the environment and nothing else."""
    n = len(cuda_blocks.BLOCK_LAUNCHES)
    lib = host_lib._lib
    args = [None] * 6 + [128, 128, 0, 0, 448.0, 1, 1]
    assert lib.te_cb_blocks(*args, n, None) != 0
    error = lib.te_cb_last_error().decode()
    assert f"launch={n}" in error and f"launch 0-{n - 1} needed" in error
    assert lib.te_cb_blocks(*args[:6], 100, 128, *args[8:], n - 1, None) != 0  # the last id passes the launch check
    assert f"launch={n - 1}" in lib.te_cb_last_error().decode()
    x = torch.ones(128, 256, dtype=torch.bfloat16)
    for bad in (n, -1, True, 1.0):
        with pytest.raises(ValueError, match=rf"launch is an index of BLOCK_LAUNCHES \(0-{n - 1}\).*{bad!r}"):
            cuda_blocks.cast_blocks(x, *E4M3, True, launch=bad)
    assert settings.current().cuda_block_cast_launch == 2  # the default: measured fastest on an H100
    for text in [str(i) for i in range(n)]:
        assert settings.from_environ({"TE_DIST_CUDA_BLOCK_CAST_LAUNCH": text})[0].cuda_block_cast_launch == int(text)
    for text in (str(n), "-1", "one"):
        with pytest.raises(ValueError, match=rf"TE_DIST_CUDA_BLOCK_CAST_LAUNCH={text!r}.*expected 0, 1 or 2"):
            settings.from_environ({"TE_DIST_CUDA_BLOCK_CAST_LAUNCH": text})
    with pytest.raises(ValueError, match="cuda_block_cast_launch"):
        with settings.override(cuda_block_cast_launch=n):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON or not torch.cuda.is_available(), reason="needs triton and a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("launch", range(len(cuda_blocks.BLOCK_LAUNCHES)))
def test_the_kernel_equals_the_triton_tile_cast(dtype, launch):
    """On the GPU: the CUDA kernel's copies == the Triton tile cast's, bit for bit, on an expert-sized input,
    plain and gathered, both scale layouts, with and without the rowwise copy, under every launch (more tiles
    than the grid's blocks, so each block walks several and refills its buffers)."""
    from te_dist.quantization import triton_casts

    x = _values(1536, 2048, seed=3, dtype=dtype).cuda()
    gather = torch.randint(0, 1536, (65536,), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    gather[::97] = -1
    for idx in (None, gather):
        for rowwise, col_scales_t in ((True, True), (False, True), (True, False)):
            assert cuda_blocks.blocks_enabled_for(x, E4M3[0], idx)
            got = cuda_blocks.cast_blocks(x, *E4M3, True, rowwise=rowwise, col_scales_t=col_scales_t, gather=idx,
                                          launch=launch)
            with settings.override(cuda_block_cast=False):
                want = triton_casts.cast_fp8_blocks(x, 1, 128, *E4M3, True, rowwise=rowwise, columnwise=True,
                                                    col_scales_t=col_scales_t, gather=idx)
            _check(got, want, f"{dtype} gather={idx is not None} rowwise={rowwise} col_scales_t={col_scales_t}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON or not torch.cuda.is_available(), reason="needs triton and a CUDA GPU")
def test_the_block_quantizer_gives_the_same_copies_with_the_switch_on():
    """Float8BlockScaling's input quantizer, a gathered expert input: the same copies either way."""
    q = make_quantizer(R.Float8BlockScaling(), "input")
    source = _values(1024, 1024, seed=9).cuda()
    index = torch.randint(0, 1024, (2048,), device="cuda")
    copies = {}
    for on in (False, True):
        with settings.override(cuda_block_cast=on):
            out = q.gathered(source, index, rowwise=True, columnwise=True)
        copies[on] = (out.rowwise.data, out.rowwise.scale_inv, out.columnwise.data, out.columnwise.scale_inv)
    _check(copies[True], copies[False], "gathered input")
