"""cuBLAS per expert for FP8 grouped GEMMs (te_dist/gemm/fp8_loop_backend.py) on CPU: the rule
that picks it (te_dist.gemm.decide), the selection through te_dist.kernels with a CUDA device faked, and
the per-tensor path's numerics (torch._scaled_mm runs tensor-scaled FP8 on CPU; the block-scaled
path is cuBLAS-only and is tested on the H200 in test_fp8_grouped_gpu.py)."""

import math

import pytest
import torch

from te_dist import kernels as K
from te_dist import recipe as R
from te_dist import support as S
from te_dist.gemm import decide, fp8_loop_backend
from te_dist.quantization import make_quantizer

CUDA = torch.device("cuda", 0)


def _why(**overrides):
    facts = dict(device=torch.device("cpu"), group_sizes=(128, 0, 256), out_dtype=torch.bfloat16, block_scales=True,
                 formats=("e4m3", "e4m3"), epilogue=False, wgrad=False, contraction=4096)
    facts.update(overrides)
    return decide.fp8_loop_why_not(**facts)


def test_the_rule_names_what_it_cannot_run():
    assert _why() is None
    assert "group sizes on the host" in _why(group_sizes=None)
    assert "bfloat16" in _why(out_dtype=torch.float32)
    assert "bias or row scale" in _why(epilogue=True)
    assert "e4m3 operands" in _why(formats=("e5m2", "e4m3"))
    assert _why(formats=("e5m2", "e4m3"), block_scales=False) is None  # HYBRID per-tensor gradients
    assert "multiples of 16" in _why(wgrad=True, group_sizes=(128, 8, 8))
    assert _why(wgrad=True, group_sizes=(128, 16, 0)) is None
    # cuBLAS's 128x128 scale rows are padded to 4: a contraction of 256 modulo 512 went wrong on the H200
    assert "multiple of 512" in _why(contraction=768)
    assert _why(contraction=768, block_scales=False) is None
    assert _why(contraction=384, wgrad=True) is None  # wgrad: 1x128 by 1x128, no 128x128 table


@pytest.mark.parametrize("block", [False, True])
def test_large_experts_win_small_ones_do_not(block):
    wins = decide.fp8_loop_wins
    # Mixtral-like fc1: 8 experts x 1024 rows, 4096 -> 28672 (240 GFLOP each)
    assert wins(8 * 1024, 4096, 28672, 8, block)
    # DeepSeek-like fc2 at EP=1: 64 x 512 rows, 2048 -> 7168 (15 GFLOP each): the grouped kernels
    assert not wins(64 * 512, 2048, 7168, 64, block)
    # DeepSeek-V3 fc1 at EP8: 32 x 1024 rows, 7168 -> 4096 (60 GFLOP): per-tensor only
    assert wins(32 * 1024, 7168, 4096, 32, block) is not block
    # the threshold itself, on the mean over experts (ragged splits)
    per_expert = decide.LOOP_MIN_FLOP_PER_EXPERT_BLOCK if block else decide.LOOP_MIN_FLOP_PER_EXPERT
    rows = math.ceil(per_expert * 4 / (2 * 1024 * 1024))
    assert wins(rows, 1024, 1024, 4, block)
    assert not wins(rows - 1, 1024, 1024, 4, block)
    assert not wins(0, 1024, 1024, 0, block)


@pytest.fixture
def fake_sm90(monkeypatch):
    """A CUDA device of compute capability 9.0 with the FP8 kernels 'available' (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with S.set_capability_lookup(lambda device: (9, 0) if device.type == "cuda" else None), \
            S.set_fp8_kernels_lookup(lambda: True):
        yield


def test_selection_through_the_kernels_entry(fake_sm90, monkeypatch):
    pick = K.select_quantized_backend
    big = dict(num_rows=8 * 1024, num_groups=8, group_sizes=(1024,) * 8)
    assert pick(CUDA, 4096, 28672, **big) == "loop"
    assert pick(CUDA, 4096, 28672, **dict(big, group_sizes=None)) == "cutlass"  # sizes not on the host
    assert pick(CUDA, 4096, 28672, epilogue=True, **big) == "cutlass"
    assert pick(CUDA, 4096, 28672, block_scales=True, a_format="e5m2", **big) == "cutlass"
    assert pick(CUDA, 4096, 28672, backend="cutlass", **big) == "cutlass"
    assert pick(CUDA, 256, 256, num_rows=512, num_groups=4, group_sizes=(128,) * 4) == "cutlass"  # small
    assert pick(CUDA, 256, 256, num_rows=512, num_groups=4, group_sizes=(128,) * 4, backend="loop") == "loop"
    with pytest.raises(ValueError, match="backend='loop' cannot run.*bias or row scale"):
        pick(CUDA, 4096, 28672, backend="loop", epilogue=True, **big)
    with pytest.raises(ValueError, match="backend='loop' cannot run.*multiples of 128"):
        pick(CUDA, 4000, 28672, backend="loop", block_scales=True, **big)  # the grouped kernels' own rules first
    with pytest.raises(ValueError, match="backend='loop' cannot run.*multiples of 16"):
        pick(CUDA, 4008, 28672, backend="loop", **big)  # tensor scales: 16-byte FP8 rows
    assert pick(CUDA, 4000, 28672, backend="loop", **big) == "loop"  # off the 128 grid, tensor-scaled
    assert pick(CUDA, 4096, 28672, block_scales=True, **big) == "loop"
    assert pick(CUDA, 4096, 28672, block_scales=True, contraction=28672 + 256, **big) == "cutlass"
    mid = dict(num_rows=8 * 2048, num_groups=8, group_sizes=(2048,) * 8)  # 69 GFLOP per expert
    assert pick(CUDA, 4096, 4096, **mid) == "loop"
    assert pick(CUDA, 4096, 4096, block_scales=True, **mid) == "cutlass"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert pick(CUDA, 4096, 28672, **big) == "cutlass"
    # kernels disabled (TE_DIST_DISABLE_CUTLASS, a failed build): the layer runs emulated, so does the call
    with S.set_fp8_kernels_lookup(lambda: False):
        assert pick(CUDA, 4096, 28672, **big) == "emulated"
        with pytest.raises(ValueError, match="backend='loop' cannot run.*FP8 grouped kernels unavailable"):
            pick(CUDA, 4096, 28672, backend="loop", **big)
    # another GPU generation: the kernels are built for sm_90a, so the same call runs emulated
    with S.set_capability_lookup(lambda device: (10, 0) if device.type == "cuda" else None), \
            S.set_fp8_kernels_lookup(lambda: True):
        assert pick(CUDA, 4096, 28672, **big) == "emulated"
        with pytest.raises(ValueError, match="sm_90a; this is sm_100"):
            pick(CUDA, 4096, 28672, backend="cutlass", **big)
    assert pick("cpu", 4096, 28672, **big) == "emulated"


def _per_tensor_operands(E, Kin, N, sizes):
    torch.manual_seed(0)
    recipe = R.Float8CurrentScaling(fp8_format=R.Format.HYBRID)
    T = sum(sizes)
    x = torch.randn(T, Kin)
    w = torch.randn(E, N, Kin) / math.sqrt(Kin)
    dy = torch.randn(T, N)
    qi, qw, qg = (make_quantizer(recipe, role) for role in ("input", "weight", "grad_output"))
    xq = qi(x, rowwise=True, columnwise=True)
    wq = K.prepare_quantized_weight(qw(w, rowwise=True, columnwise=True))
    dyq = qg(dy, rowwise=True, columnwise=True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return xq, wq, dyq, offs


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def test_per_tensor_per_expert_matches_the_emulated_reference():
    """Ragged 16-row groups with an empty expert; e5m2 gradients (HYBRID). The emulated path
    multiplies the same quantized values in float32 on CPU."""
    sizes = [48, 0, 16, 208]
    E, Kin, N = 4, 256, 384
    xq, wq, dyq, offs = _per_tensor_operands(E, Kin, N, sizes)
    got = {
        "fwd": fp8_loop_backend.forward(xq, wq, offs, group_sizes=sizes),
        "dgrad": fp8_loop_backend.dgrad(dyq, wq, offs, group_sizes=sizes),
        "wgrad": fp8_loop_backend.wgrad(xq, dyq, offs, E, group_sizes=sizes),
    }
    want = {
        "fwd": K.grouped_mm_quantized_forward(xq, wq, offs, backend="emulated"),
        "dgrad": K.grouped_mm_quantized_dgrad(dyq, wq, offs, backend="emulated"),
        "wgrad": K.grouped_mm_quantized_wgrad(xq, dyq, offs, num_groups=E, backend="emulated"),
    }
    for direction in got:
        assert got[direction].shape == want[direction].shape, direction
        assert got[direction].dtype == torch.bfloat16
        assert _rel(got[direction], want[direction]) < 5e-3, direction
    assert got["wgrad"][1].abs().max().item() == 0.0  # the empty expert's weight gradient
    assert got["fwd"].shape[0] == sum(sizes)


def test_bad_sizes_are_named_before_anything_runs(fake_sm90):
    big = dict(num_rows=8 * 1024, num_groups=8)
    with pytest.raises(ValueError, match="sum to"):
        K.select_quantized_backend(CUDA, 4096, 28672, group_sizes=(1024,) * 7 + (1000,), **big)
    with pytest.raises(ValueError, match="8 experts"):
        K.select_quantized_backend(CUDA, 4096, 28672, group_sizes=(1024,) * 4, **big)
    with pytest.raises(TypeError, match="list or tuple of ints"):
        K.select_quantized_backend(CUDA, 4096, 28672, group_sizes="1024", **big)
