"""The per-expert loop backend on CUDA (fp16/fp32 calls and odd shapes land there) against a
float64 reference: forward with bias and row scale, dgrad, wgrad, zero-row experts."""

import pytest
import torch

from te_dist import kernels

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_loop_on_cuda_matches_float64(dtype):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sizes = [40, 0, 1, 23]
    E, K, N, T = len(sizes), 48, 40, sum(sizes)
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(T, K, device=dev, dtype=dtype)
    w_ENK = torch.randn(E, N, K, device=dev, dtype=dtype)
    bias = torch.randn(E, N, device=dev, dtype=dtype)
    scale = torch.rand(T, device=dev)
    dy = torch.randn(T, N, device=dev, dtype=dtype)
    w = w_ENK.transpose(1, 2)
    y = kernels.grouped_mm_forward(x, w, offs, bias_EN=bias, row_scale_T=scale, backend="loop")
    dx = kernels.grouped_mm_dgrad(dy, w, offs, row_scale_T=scale, backend="loop")
    dw = kernels.grouped_mm_wgrad(x, dy, offs, num_groups=E, backend="loop")

    x64, w64, dy64 = x.double(), w.double(), dy.double()
    y_ref, dx_ref, dw_ref = torch.zeros(T, N, dtype=torch.float64, device=dev), torch.zeros(T, K, dtype=torch.float64, device=dev), torch.zeros(E, K, N, dtype=torch.float64, device=dev)
    start = 0
    for e, n in enumerate(sizes):
        rows = slice(start, start + n)
        y_ref[rows] = scale[rows, None].double() * (x64[rows] @ w64[e]) + bias[e].double()
        dx_ref[rows] = scale[rows, None].double() * (dy64[rows] @ w64[e].T)
        dw_ref[e] = x64[rows].T @ dy64[rows]
        start += n
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for out, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    assert torch.count_nonzero(dw[1]) == 0  # the expert with no rows gets a zero gradient
