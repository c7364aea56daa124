"""E2M1 grid, round-to-nearest-even ties, saturation, packing order, stochastic rounding."""

import pytest
import torch

from te_dist.quantization.e2m1 import (
    E2M1_VALUES,
    e2m1_codes_to_float,
    pack_e2m1,
    round_to_e2m1_codes,
    stochastic_round_to_e2m1_codes,
    unpack_e2m1,
)


def _rtn(values, device):
    x = torch.tensor(values, dtype=torch.float32, device=device)
    return e2m1_codes_to_float(round_to_e2m1_codes(x)).cpu().tolist()


def test_grid_values_round_trip_exactly(device):
    grid = torch.tensor(E2M1_VALUES, device=device)
    codes = round_to_e2m1_codes(grid)
    assert codes.cpu().tolist() == list(range(8))
    assert e2m1_codes_to_float(codes).cpu().tolist() == list(E2M1_VALUES)
    neg = round_to_e2m1_codes(-grid[1:])
    assert neg.cpu().tolist() == [8 + c for c in range(1, 8)]  # sign is bit 3 of the nibble
    assert e2m1_codes_to_float(neg).cpu().tolist() == [-v for v in E2M1_VALUES[1:]]


def test_ties_round_to_even_code(device):
    # midpoint -> (lower code, upper code): the even code wins
    assert _rtn([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device) == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert _rtn([-0.75, -2.5, -5.0], device) == [-1.0, -2.0, -4.0]


def test_nearest_and_saturation(device):
    assert _rtn([0.26, 0.74, 1.3, 2.6, 4.9, 5.1, 6.0, 7.0, 1e30, -1e30], device) == [
        0.5, 0.5, 1.5, 3.0, 4.0, 6.0, 6.0, 6.0, 6.0, -6.0
    ]
    assert _rtn([float("inf"), float("-inf")], device) == [6.0, -6.0]


def test_negative_zero_keeps_its_sign(device):
    codes = round_to_e2m1_codes(torch.tensor([-0.0, -0.1], device=device))
    assert codes.cpu().tolist() == [8, 8]
    assert torch.signbit(e2m1_codes_to_float(codes)).all()


def test_packing_order_low_nibble_first(device):
    codes = torch.tensor([[1, 2, 3, 4, 0xF, 0x8]], dtype=torch.uint8, device=device)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.uint8
    assert packed.cpu().tolist() == [[0x21, 0x43, 0x8F]]
    assert torch.equal(unpack_e2m1(packed), codes)


def test_unpack_inverts_pack_on_all_bytes(device):
    every_byte = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).reshape(4, 64)
    assert torch.equal(pack_e2m1(unpack_e2m1(every_byte)), every_byte)


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even last dimension"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("value", [0.3, 1.1, 1.6, 2.7, 3.2, 4.5, -5.0, -0.1])
def test_stochastic_rounding_is_unbiased(device, value):
    n = 40_000
    gen = torch.Generator(device=device).manual_seed(1234)
    x = torch.full((n,), value, device=device)
    noise = torch.rand(n, device=device, generator=gen)
    out = e2m1_codes_to_float(stochastic_round_to_e2m1_codes(x, noise))
    grid = torch.tensor(E2M1_VALUES, device=device)
    mag = abs(value)
    lo = grid[grid <= mag].max().item()
    hi = grid[grid >= mag].min().item()
    sign = -1.0 if value < 0 else 1.0
    # only the two neighbours ever appear
    assert set(out.abs().unique().cpu().tolist()) <= {lo, hi}
    p = (mag - lo) / (hi - lo)
    sigma = (hi - lo) * (p * (1 - p) / n) ** 0.5
    assert abs(out.mean().item() - value) < 5 * sigma + 1e-7
    # round-to-nearest on the same values is biased by more than that
    rtn_bias = abs(e2m1_codes_to_float(round_to_e2m1_codes(x[:1])).item() - value)
    assert rtn_bias > 5 * sigma
    assert sign * out.min().item() >= 0 or value == 0


def test_stochastic_rounding_keeps_grid_values_and_saturates(device):
    grid = torch.tensor(E2M1_VALUES + (7.0, 100.0), device=device)
    noise = torch.full_like(grid, 0.999)
    out = e2m1_codes_to_float(stochastic_round_to_e2m1_codes(grid, noise))
    assert out.cpu().tolist() == list(E2M1_VALUES) + [6.0, 6.0]
