"""Pure scale math with exact expected values: per-tensor, power of two, OCP MX exponents, NVFP4."""

import math

import torch

from te_dist.quantization.scaling import (
    compute_amax,
    e8m0_from_exponent,
    e8m0_to_float,
    mx_shared_exponent,
    nvfp4_block_scales,
    nvfp4_global_scale,
    per_tensor_scale,
    pow2_from_exponent,
    round_down_pow2,
)

NAN, INF = float("nan"), float("inf")


def _t(values, device, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, device=device)


def test_compute_amax(device):
    assert compute_amax(_t([1.0, -3.5, 2.0], device, torch.bfloat16)).item() == 3.5
    assert compute_amax(_t([[1.0], [-7.0]], device)).dtype == torch.float32
    assert math.isnan(compute_amax(_t([1.0, NAN], device)).item())
    assert compute_amax(torch.empty(0, 4, device=device)).item() == 0.0


def test_per_tensor_scale_known_values(device):
    amax = _t([2.0, 448.0, 0.5], device)
    assert per_tensor_scale(amax, 448.0).cpu().tolist() == [224.0, 1.0, 896.0]
    assert per_tensor_scale(amax, 448.0, margin=2).cpu().tolist() == [56.0, 0.25, 224.0]
    assert per_tensor_scale(amax, 57344.0).cpu().tolist() == [28672.0, 128.0, 114688.0]


def test_power_2_scales_round_down(device):
    assert per_tensor_scale(_t([2.0, 3.0, 0.3], device), 448.0, power_2=True).cpu().tolist() == [128.0, 128.0, 1024.0]
    assert round_down_pow2(_t([3.0, 4.0, 0.7, 1.0], device)).cpu().tolist() == [2.0, 4.0, 0.5, 1.0]


def test_degenerate_amax_never_gives_zero_or_infinite_scale(device):
    scale = per_tensor_scale(_t([0.0, NAN, INF, 1e-45], device), 448.0)
    assert scale[:3].cpu().tolist() == [1.0, 1.0, 1.0]
    assert scale[3].item() == torch.finfo(torch.float32).max
    fallback = _t(7.0, device)
    assert per_tensor_scale(_t([0.0, NAN, 4.0], device), 448.0, fallback=fallback).cpu().tolist() == [7.0, 7.0, 112.0]


def test_mx_exponent_rule(device):
    # X = floor(log2(amax)) - emax_elem, E4M3 emax_elem = 8, E5M2 = 15
    amax = _t([448.0, 1.0, 3.0, 500.0, 0.0, 2.0**-130, 0.75], device)
    assert mx_shared_exponent(amax, 8).cpu().tolist() == [0, -8, -7, 0, -127, -127, -9]
    assert mx_shared_exponent(amax, 15).cpu().tolist() == [-7, -15, -14, -7, -127, -127, -16]
    assert mx_shared_exponent(_t([1.0], device), 8, margin=2).cpu().tolist() == [-6]
    assert mx_shared_exponent(_t([2.0**127 * 1.5], device), 8).item() == 119
    assert mx_shared_exponent(_t([2.0**-120], device), 8).item() == -127  # clamped at the E8M0 minimum


def test_e8m0_encoding(device):
    exponent = torch.tensor([0, -8, 127, -127, 3], dtype=torch.int32, device=device)
    amax = _t([1.0, 1.0, 1.0, 1.0, NAN], device)
    e8m0 = e8m0_from_exponent(exponent, amax)
    assert e8m0.dtype == torch.float8_e8m0fnu
    assert e8m0.view(torch.uint8).cpu().tolist() == [127, 119, 254, 0, 255]
    values = e8m0_to_float(e8m0).cpu()
    assert values[:4].tolist() == [1.0, 2.0**-8, 2.0**127, 2.0**-127]
    assert math.isnan(values[4].item())


def test_pow2_from_exponent_is_exact(device):
    e = torch.arange(-126, 128, dtype=torch.int32, device=device)
    assert torch.equal(pow2_from_exponent(e).cpu(), torch.tensor([2.0**k for k in range(-126, 128)]))


def test_nvfp4_scales(device):
    s_enc = nvfp4_global_scale(_t(2688.0, device))
    assert s_enc.item() == 1.0
    assert nvfp4_global_scale(_t(6.0, device)).item() == 448.0
    assert nvfp4_global_scale(_t(0.0, device)).item() == 1.0
    # block amax 6 -> decode scale 1; 12 -> 2; 3 -> 0.5; 0 -> 0 (factor 0); 6000 -> clamped to 448
    scale, factor = nvfp4_block_scales(_t([6.0, 12.0, 3.0, 0.0, 6000.0], device), s_enc)
    assert scale.dtype == torch.float8_e4m3fn
    assert scale.float().cpu().tolist() == [1.0, 2.0, 0.5, 0.0, 448.0]
    assert factor[:4].cpu().tolist() == [1.0, 0.5, 2.0, 0.0]
    assert factor[4].item() == torch.tensor(1.0 / 448.0).item()  # float32 division
    scale, factor = nvfp4_block_scales(_t([NAN], device), s_enc)
    assert math.isnan(scale.float().item()) and math.isnan(factor.item())
