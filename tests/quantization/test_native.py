"""Native FP8 GEMM paths: fall back to the emulated GEMMs off-GPU, match them on SM89+/SM90."""

import pytest
import torch

from te_dist import recipe as R
from te_dist.quantization import (
    emulated_gemm,
    emulated_grouped_gemm,
    make_quantizer,
    native_fp8_gemm_supported,
    native_fp8_grouped_gemm_supported,
    scaled_gemm,
    scaled_grouped_gemm,
)


def test_cpu_is_not_native_and_falls_back_exactly():
    assert not native_fp8_gemm_supported("cpu") and not native_fp8_grouped_gemm_supported("cpu")
    recipe = R.Float8CurrentScaling()
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    y = scaled_gemm(a, b, make_quantizer(recipe, "input"), make_quantizer(recipe, "weight"))
    torch.testing.assert_close(y, emulated_gemm(a, b, make_quantizer(recipe, "input"), make_quantizer(recipe, "weight")))
    x, w = torch.randn(10, 32), torch.randn(2, 32, 16)
    offsets = torch.tensor([3, 10])
    y = scaled_grouped_gemm(x, w, offsets, make_quantizer(recipe, "input"), make_quantizer(recipe, "weight"))
    ref = emulated_grouped_gemm(x, w, offsets, make_quantizer(recipe, "input"), make_quantizer(recipe, "weight"))
    torch.testing.assert_close(y, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [R.Format.E4M3, R.Format.HYBRID])
def test_scaled_mm_matches_emulation(cuda_device, fmt):
    if not native_fp8_gemm_supported(cuda_device):
        pytest.fail("the GPU tests expect an SM89+ device (H200)")
    torch.manual_seed(0)
    recipe = R.Float8CurrentScaling(fp8_format=fmt)
    a = torch.randn(256, 512, device=cuda_device, dtype=torch.bfloat16)
    b = torch.randn(512, 128, device=cuda_device, dtype=torch.bfloat16)
    for qa_role, qb_role in [("input", "weight"), ("grad_output", "weight")]:
        y = scaled_gemm(a, b, make_quantizer(recipe, qa_role), make_quantizer(recipe, qb_role))
        ref = emulated_gemm(a, b, make_quantizer(recipe, qa_role), make_quantizer(recipe, qb_role), out_dtype=torch.float32)
        assert y.dtype == torch.bfloat16 and y.shape == (256, 128)
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
def test_scaled_grouped_mm_matches_emulation(cuda_device):
    if not native_fp8_grouped_gemm_supported(cuda_device):
        pytest.fail("the GPU tests expect an SM90 device (H200)")
    torch.manual_seed(0)
    recipe = R.Float8CurrentScaling(fp8_format=R.Format.E4M3)
    x = torch.randn(96, 256, device=cuda_device, dtype=torch.bfloat16)
    w = torch.randn(4, 128, 256, device=cuda_device, dtype=torch.bfloat16).transpose(1, 2)  # [E, K, N] view
    offsets = torch.tensor([16, 16, 64, 96], device=cuda_device, dtype=torch.int32)
    y = scaled_grouped_gemm(x, w, offsets, make_quantizer(recipe, "input"), make_quantizer(recipe, "weight"))
    ref = emulated_grouped_gemm(x, w, offsets, make_quantizer(recipe, "input"), make_quantizer(recipe, "weight"),
                                out_dtype=torch.float32)
    assert y.dtype == torch.bfloat16 and y.shape == (96, 128)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
