"""Block formats on crafted tensors: Float8 1x128 / 128x128, MXFP8 E8M0 exponents, NVFP4 packing and scales."""

import math

import pytest
import torch

from te_dist import recipe as R
from te_dist.quantization import Float8BlockTensor, MXFP8Tensor, NVFP4Tensor, make_quantizer
from te_dist.quantization.e2m1 import E2M1_VALUES
from te_dist.quantization.hadamard import apply_rht


# ----------------------------------------------------------------------------- Float8BlockScaling
def _two_block_rows(device):
    x = torch.zeros(2, 256, device=device)
    x[0, 5], x[0, 130] = 4.0, -0.5  # row 0: block amaxes 4 and 0.5
    x[1, 0] = 3.0  # row 1: block amaxes 3 and 0 (all-zero block)
    return x


def test_float8_block_1x128_scales(device):
    x = _two_block_rows(device)
    q = make_quantizer(R.Float8BlockScaling(use_power_2_scales=False), "input")(x)
    assert isinstance(q, Float8BlockTensor) and q.columnwise is None
    row = q.rowwise
    assert (row.block_rows, row.block_cols) == (1, 128)
    assert row.data.shape == (2, 256) and row.data.dtype == torch.float8_e4m3fn
    assert row.scale_inv.dtype == torch.float32 and row.scale_inv.shape == (2, 2)
    expected = torch.tensor([[4 / 448, 0.5 / 448], [3 / 448, 1.0]])
    torch.testing.assert_close(row.scale_inv.cpu(), expected, rtol=1e-6, atol=0)
    assert row.data.float()[0, 5].item() == 448.0 and row.data.float()[0, 130].item() == -448.0
    torch.testing.assert_close(q.dequantize(), x, rtol=1e-6, atol=0)


def test_float8_block_power_2_scales(device):
    q = make_quantizer(R.Float8BlockScaling(), "grad_output")(_two_block_rows(device))
    # scale = 2**floor(log2(448 / amax)): 448/4=112 -> 64, 448/0.5=896 -> 512, 448/3 -> 128, zero block -> 1
    assert q.rowwise.scale_inv.cpu().tolist() == [[1 / 64, 1 / 512], [1 / 128, 1.0]]
    assert q.rowwise.data.float()[0, 5].item() == 256.0


def test_float8_block_128x128_weight_and_columnwise(device):
    w = torch.randn(128, 256, device=device)
    w[3, 200] = 50.0
    q = make_quantizer(R.Float8BlockScaling(), "weight")(w, columnwise=True)
    row, col = q.rowwise, q.columnwise
    assert (row.block_rows, row.block_cols) == (128, 128)
    assert row.scale_inv.shape == (1, 2) and col.scale_inv.shape == (2, 1)
    assert col.transposed and col.data.shape == (256, 128)
    # one tile, two orientations: same scales
    assert torch.equal(col.scale_inv.T, row.scale_inv)
    assert torch.equal(col.data.float().T, row.data.float())
    assert row.scale_inv[0, 1].item() == 2.0 ** math.ceil(math.log2(50.0 / 448.0))
    torch.testing.assert_close(q.dequantize(usage="columnwise"), q.dequantize(usage="rowwise"))


def test_float8_block_hybrid_gradients_are_e5m2(device):
    recipe = R.Float8BlockScaling(fp8_format=R.Format.HYBRID)
    x = torch.randn(4, 128, device=device)
    assert make_quantizer(recipe, "input")(x).rowwise.data.dtype == torch.float8_e4m3fn
    assert make_quantizer(recipe, "grad_output")(x).rowwise.data.dtype == torch.float8_e5m2


def test_block_tiling_errors_name_dim_and_padding(device):
    quantizer = make_quantizer(R.Float8BlockScaling(), "input")
    with pytest.raises(ValueError, match=r"last dim is 100, not a multiple of 128; pad it to 128"):
        quantizer(torch.zeros(4, 100, device=device))
    with pytest.raises(ValueError, match=r"second-to-last dim is 4, not a multiple of 128"):
        quantizer(torch.zeros(4, 128, device=device), columnwise=True)
    with pytest.raises(ValueError, match=r"second-to-last dim is 64, not a multiple of 128; pad it to 128"):
        make_quantizer(R.Float8BlockScaling(), "weight")(torch.zeros(64, 128, device=device))
    with pytest.raises(ValueError, match=r"not a multiple of 32; pad it to 64"):
        make_quantizer(R.MXFP8BlockScaling(), "input")(torch.zeros(2, 48, device=device))
    with pytest.raises(ValueError, match=r"not a multiple of 16; pad it to 32"):
        make_quantizer(R.NVFP4BlockScaling(), "input")(torch.zeros(2, 24, device=device))
    with pytest.raises(ValueError, match=r"16x16 blocks"):
        make_quantizer(R.NVFP4BlockScaling(), "weight")(torch.zeros(8, 32, device=device))


# ----------------------------------------------------------------------------- MXFP8
def test_mxfp8_e8m0_exponents_and_elements(device):
    x = torch.zeros(1, 96, device=device)
    x[0, 0], x[0, 1] = 1.0, 0.5  # block 0: amax 1 -> X = 0 - 8 = -8
    x[0, 32], x[0, 33] = 3.0, -0.75  # block 1: amax 3 -> X = 1 - 8 = -7
    x[0, 64] = 500.0  # block 2: amax 500 -> X = 8 - 8 = 0, 500 saturates to 448 (OCP floor rule)
    q = make_quantizer(R.MXFP8BlockScaling(), "input")(x)
    assert isinstance(q, MXFP8Tensor)
    row = q.rowwise
    assert row.scale_inv.dtype == torch.float8_e8m0fnu and row.scale_inv.shape == (1, 3)
    assert row.scale_inv.view(torch.uint8).cpu().tolist() == [[119, 120, 127]]
    data = row.data.float().cpu()[0]
    assert data[[0, 1, 32, 33, 64]].tolist() == [256.0, 128.0, 384.0, -96.0, 448.0]
    out = q.dequantize().cpu()[0]
    assert out[[0, 1, 32, 33, 64]].tolist() == [1.0, 0.5, 3.0, -0.75, 448.0]


def test_mxfp8_zero_and_nan_blocks(device):
    x = torch.zeros(1, 64, device=device)
    x[0, 40] = float("nan")
    q = make_quantizer(R.MXFP8BlockScaling(), "input")(x)
    assert q.rowwise.scale_inv.view(torch.uint8).cpu().tolist() == [[0, 255]]  # 2**-127 and NaN
    out = q.dequantize().cpu()
    assert torch.equal(out[0, :32], torch.zeros(32))
    assert torch.isnan(out[0, 32:]).all()  # the NaN scale poisons its own block only


def test_mxfp8_e5m2_and_margin(device):
    x = torch.zeros(1, 32, device=device)
    x[0, 0] = 1.0
    q = make_quantizer(R.MXFP8BlockScaling(fp8_format=R.Format.E5M2), "grad_output")(x)
    assert q.rowwise.data.dtype == torch.float8_e5m2
    assert q.rowwise.scale_inv.view(torch.uint8).item() == 127 - 15
    q = make_quantizer(R.MXFP8BlockScaling(margin=2), "input")(x)
    assert q.rowwise.scale_inv.view(torch.uint8).item() == 127 - 8 + 2
    assert q.rowwise.data.float()[0, 0].item() == 64.0


def test_mxfp8_columnwise(device):
    x = torch.randn(64, 32, device=device)
    q = make_quantizer(R.MXFP8BlockScaling(), "input")(x, rowwise=False, columnwise=True)
    assert q.rowwise is None and q.columnwise.data.shape == (32, 64) and q.columnwise.scale_inv.shape == (32, 2)
    col_amax = x.abs().reshape(2, 32, 32).amax(1).T  # [32 cols, 2 row-blocks]
    expected = torch.floor(torch.log2(col_amax)).to(torch.int32) - 8 + 127
    assert torch.equal(q.columnwise.scale_inv.view(torch.uint8).to(torch.int32), expected)
    err = (q.dequantize() - x).abs() / x.abs().clamp(min=2.0**-6)
    assert err.max().item() <= 2.0**-3


# ----------------------------------------------------------------------------- NVFP4
def test_nvfp4_values_on_grid_and_packing(device):
    grid = torch.tensor(E2M1_VALUES, device=device)
    x = torch.cat((grid, -grid)).reshape(1, 16)  # amax 6 -> s_enc 448, block scale 448, factor 1
    q = make_quantizer(R.NVFP4BlockScaling(), "input")(x)
    assert isinstance(q, NVFP4Tensor)
    row = q.rowwise
    assert row.data.dtype == torch.uint8 and row.data.shape == (1, 8)
    assert row.scale_inv.dtype == torch.float8_e4m3fn and row.scale_inv.float().item() == 448.0
    assert row.global_scale_inv.item() == pytest.approx(1 / 448, rel=1e-7)
    # codes 0..7 then 8..15 (negative zero is code 8); element 2i low nibble, 2i+1 high nibble
    assert row.data.cpu().tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    torch.testing.assert_close(q.dequantize(), x, rtol=1e-6, atol=0)


def test_nvfp4_two_level_scales(device):
    x = torch.zeros(1, 32, device=device)
    x[0, 0] = 12.0  # tensor amax 12: s_enc = 2688 / 12 = 224
    x[0, 16], x[0, 17] = 3.0, 1.0  # block 1 amax 3: decode scale 3/6*224 = 112
    q = make_quantizer(R.NVFP4BlockScaling(), "input")(x)
    assert q.rowwise.scale_inv.float().cpu().tolist() == [[448.0, 112.0]]
    torch.testing.assert_close(q.rowwise.global_scale_inv.cpu(), torch.tensor(1 / 224))
    out = q.dequantize().cpu()
    assert out[0, [0, 16, 17]].tolist() == pytest.approx([12.0, 3.0, 1.0], rel=1e-6)


def test_nvfp4_2d_weight_blocks(device):
    w = torch.randn(32, 48, device=device)
    q = make_quantizer(R.NVFP4BlockScaling(), "weight")(w)
    assert (q.rowwise.block_rows, q.rowwise.block_cols) == (16, 16)
    assert q.rowwise.scale_inv.shape == (2, 3)
    q1d = make_quantizer(R.NVFP4BlockScaling(disable_2d_quantization=True), "weight")(w)
    assert (q1d.rowwise.block_rows, q1d.rowwise.block_cols) == (1, 16) and q1d.rowwise.scale_inv.shape == (32, 3)
    # one amax per 16x16 tile: every 1x16 block scale is <= its tile's scale
    assert (q1d.rowwise.scale_inv.float().reshape(2, 16, 3) <= q.rowwise.scale_inv.float()[:, None, :]).all()


def test_nvfp4_rht_only_on_the_columnwise_copy(device):
    torch.manual_seed(0)
    x = torch.randn(32, 64, device=device)
    q = make_quantizer(R.NVFP4BlockScaling(disable_stochastic_rounding=True), "input")(x, columnwise=True)
    assert not q.rowwise.hadamard and q.columnwise.hadamard
    # the stored columnwise copy is the quantized transform of x.T
    ref = make_quantizer(R.NVFP4BlockScaling(disable_rht=True), "input")(apply_rht(x.T.contiguous()))
    assert torch.equal(q.columnwise.data, ref.rowwise.data)
    rel = (q.dequantize(usage="columnwise") - x).norm() / x.norm()
    assert rel.item() < 0.15
    q_off = make_quantizer(R.NVFP4BlockScaling(disable_rht=True), "input")(x, columnwise=True)
    assert not q_off.columnwise.hadamard
    assert not make_quantizer(R.NVFP4BlockScaling(), "weight").wants_rht


def test_nvfp4_stochastic_rounding_of_gradients_is_unbiased(device):
    torch.manual_seed(0)
    g = torch.randn(16, 64, device=device)
    quantizer = make_quantizer(R.NVFP4BlockScaling(disable_rht=True), "grad_output")
    assert quantizer.stochastic_rounding
    torch.manual_seed(1)
    samples = torch.stack([quantizer(g).dequantize() for _ in range(400)])
    assert not torch.equal(samples[0], samples[1])  # really random
    mean_err = (samples.mean(0) - g).abs().mean().item()
    rtn = make_quantizer(R.NVFP4BlockScaling(disable_stochastic_rounding=True), "grad_output")(g).dequantize()
    rtn_err = (rtn - g).abs().mean().item()
    assert mean_err < rtn_err / 4  # averaging SR samples converges to g, RTN error does not shrink
    # reproducible with the global seed
    torch.manual_seed(7)
    a = quantizer(g).rowwise.data
    torch.manual_seed(7)
    assert torch.equal(quantizer(g).rowwise.data, a)


def test_nvfp4_nan_is_visible(device):
    x = torch.ones(1, 32, device=device)
    x[0, 20] = float("nan")
    out = make_quantizer(R.NVFP4BlockScaling(), "input")(x).dequantize().cpu()
    assert torch.isnan(out[0, 16:]).all()


def test_nvfp4_stochastic_rounding_with_own_generator(device):
    g = torch.randn(16, 64, device=device)
    recipe = R.NVFP4BlockScaling()

    def run(seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        quantizer = make_quantizer(recipe, "grad_output", generator=gen)
        return quantizer(g).rowwise.data, quantizer(g).rowwise.data

    first, second = run(3)
    again, _ = run(3)
    assert torch.equal(first, again)  # same generator seed, same rounding
    assert not torch.equal(first, second)  # the generator advances
