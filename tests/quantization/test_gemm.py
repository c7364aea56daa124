"""Emulated quantized GEMM and grouped GEMM: references, padding, RHT in wgrad, zero-token experts, errors."""

import pytest
import torch

from te_dist import recipe as R
from te_dist.quantization import emulated_gemm, emulated_grouped_gemm, fake_quantize, make_quantizer

RECIPES = {
    "delayed": lambda: R.DelayedScaling(),
    "current": lambda: R.Float8CurrentScaling(),
    "block": lambda: R.Float8BlockScaling(),
    "mxfp8": lambda: R.MXFP8BlockScaling(),
    "nvfp4": lambda: R.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
BOUND = {"delayed": 0.5, "current": 0.08, "block": 0.06, "mxfp8": 0.06, "nvfp4": 0.25}  # delayed: first step scale 1


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_no_quantizers_is_a_plain_matmul(device):
    a, b = torch.randn(5, 7, device=device), torch.randn(7, 3, device=device)
    torch.testing.assert_close(emulated_gemm(a, b, None, None), a @ b)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_gemm_matches_dequantized_reference(device, name):
    torch.manual_seed(0)
    recipe = RECIPES[name]()
    a, b = torch.randn(128, 256, device=device), torch.randn(256, 128, device=device)
    qa, qb = make_quantizer(recipe, "input"), make_quantizer(recipe, "weight")
    y = emulated_gemm(a, b, qa, qb)
    assert 0 < _rel(y, a @ b) < BOUND[name]
    # the same computation spelled out: rowwise a, columnwise b (fresh quantizers: delayed is stateful)
    qa2, qb2 = make_quantizer(recipe, "input"), make_quantizer(recipe, "weight")
    ref = fake_quantize(a, qa2) @ fake_quantize(b, qb2, usage="columnwise")
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_shapes_that_do_not_tile_are_zero_padded(device, name):
    torch.manual_seed(1)
    recipe = RECIPES[name]()
    a, b = torch.randn(5, 40, device=device), torch.randn(40, 7, device=device)
    y = emulated_gemm(a, b, make_quantizer(recipe, "input"), make_quantizer(recipe, "weight"))
    assert y.shape == (5, 7)
    assert _rel(y, a @ b) < BOUND[name]


def test_output_dtype(device):
    a = torch.randn(4, 32, device=device, dtype=torch.bfloat16)
    b = torch.randn(32, 8, device=device, dtype=torch.bfloat16)
    quantizer = make_quantizer(R.MXFP8BlockScaling(), "input")
    assert emulated_gemm(a, b, quantizer, quantizer).dtype == torch.bfloat16
    assert emulated_gemm(a, b, quantizer, quantizer, out_dtype=torch.float32).dtype == torch.float32


def test_nvfp4_wgrad_applies_rht_to_both_operands(device):
    torch.manual_seed(2)
    recipe = R.NVFP4BlockScaling(disable_stochastic_rounding=True)
    dy, x = torch.randn(64, 32, device=device), torch.randn(64, 48, device=device)
    dy[5, 3] = 40.0  # an outlier along the reduction (token) dim
    grad_q, input_q = make_quantizer(recipe, "grad_output"), make_quantizer(recipe, "input")
    dw = emulated_gemm(dy.t(), x, grad_q, input_q)
    ref = fake_quantize(dy.t(), grad_q, hadamard=True) @ fake_quantize(x, input_q, usage="columnwise", hadamard=True)
    torch.testing.assert_close(dw, ref)
    no_rht = fake_quantize(dy.t(), grad_q, hadamard=False) @ fake_quantize(x, input_q, usage="columnwise", hadamard=False)
    assert not torch.allclose(dw, no_rht)
    assert _rel(dw, dy.t() @ x) < 0.3
    # fprop with a weight never uses the transform
    w_q = make_quantizer(recipe, "weight")
    y = emulated_gemm(x, torch.randn(48, 16, device=device), input_q, w_q)
    assert y.shape == (64, 16)


def test_gemm_gradients_flow_straight_through(device):
    a = torch.randn(8, 32, device=device, requires_grad=True)
    b = torch.randn(32, 4, device=device, requires_grad=True)
    recipe = R.MXFP8BlockScaling()
    emulated_gemm(a, b, make_quantizer(recipe, "input"), make_quantizer(recipe, "weight")).sum().backward()
    b_dq = fake_quantize(b.detach(), make_quantizer(recipe, "weight"), usage="columnwise")
    torch.testing.assert_close(a.grad, torch.ones(8, 4, device=device) @ b_dq.T)


def test_gemm_errors(device):
    q = make_quantizer(R.Float8CurrentScaling(), "input")
    with pytest.raises(ValueError, match=r"a\[M, K\] and b\[K, N\]"):
        emulated_gemm(torch.ones(2, 3, device=device), torch.ones(4, 5, device=device), q, q)
    with pytest.raises(TypeError, match="Quantizer or None"):
        emulated_gemm(torch.ones(2, 3, device=device), torch.ones(3, 5, device=device), "fp8", q)
    with pytest.raises(TypeError, match="floating dtype"):
        emulated_gemm(torch.ones(2, 3, dtype=torch.int64, device=device), torch.ones(3, 5, device=device), q, q)


# ----------------------------------------------------------------------------- grouped
def _grouped_reference(x, w, ends, recipe):
    pieces, start = [], 0
    for e, end in enumerate(ends):
        pieces.append(emulated_gemm(x[start:end], w[e], make_quantizer(recipe, "input"), make_quantizer(recipe, "weight")))
        start = end
    return torch.cat(pieces)


@pytest.mark.parametrize("name", ["block", "mxfp8", "nvfp4"])
def test_grouped_matches_per_expert_gemms_for_block_formats(device, name):
    """Row-wise x blocks and per-expert w blocks do not depend on the grouping (NVFP4's tensor-level
    scale does: there only the error bound applies)."""
    torch.manual_seed(3)
    recipe = RECIPES[name]()
    x, w_enk = torch.randn(40, 128, device=device), torch.randn(4, 128, 128, device=device)
    w = w_enk.transpose(1, 2)  # [E, K, N] view of a contiguous [E, N, K], as GroupedLinear stores it
    ends = [10, 10, 33, 40]  # expert 1 gets zero tokens
    offsets = torch.tensor(ends, dtype=torch.int32, device=device)
    y = emulated_grouped_gemm(x, w, offsets, make_quantizer(recipe, "input"), make_quantizer(recipe, "weight"))
    if name != "nvfp4":
        torch.testing.assert_close(y, _grouped_reference(x, w, ends, recipe))
    ref = torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))])
    assert _rel(y, ref) < BOUND[name]


def test_grouped_per_tensor_uses_one_weight_scale(device):
    torch.manual_seed(4)
    recipe = R.Float8CurrentScaling()
    x, w = torch.randn(12, 32, device=device), torch.randn(3, 32, 16, device=device)
    offsets = torch.tensor([4, 4, 12], device=device)
    y = emulated_grouped_gemm(x, w, offsets, make_quantizer(recipe, "input"), make_quantizer(recipe, "weight"))
    x_dq = fake_quantize(x, make_quantizer(recipe, "input"))
    w_dq = fake_quantize(w, make_quantizer(recipe, "weight"))
    ref = torch.cat([x_dq[:4] @ w_dq[0], x_dq[4:4] @ w_dq[1], x_dq[4:] @ w_dq[2]])
    torch.testing.assert_close(y, ref)
    assert y.shape == (12, 16)


def test_grouped_all_tokens_to_one_expert_and_no_tokens(device):
    recipe = R.MXFP8BlockScaling()
    w = torch.randn(3, 32, 8, device=device)
    x = torch.randn(6, 32, device=device)
    y = emulated_grouped_gemm(x, w, torch.tensor([0, 6, 6], device=device), make_quantizer(recipe, "input"),
                              make_quantizer(recipe, "weight"))
    torch.testing.assert_close(y, emulated_gemm(x, w[1], make_quantizer(recipe, "input"), make_quantizer(recipe, "weight")))
    empty = emulated_grouped_gemm(x[:0], w, torch.zeros(3, dtype=torch.int64, device=device), None, None)
    assert empty.shape == (0, 8)


def test_grouped_offset_errors(device):
    x, w = torch.randn(6, 32, device=device), torch.randn(3, 32, 8, device=device)
    q = make_quantizer(R.MXFP8BlockScaling(), "input")
    with pytest.raises(ValueError, match=r"shape \[E=3\]"):
        emulated_grouped_gemm(x, w, torch.tensor([6], device=device), q, q)
    with pytest.raises(ValueError, match="non-decreasing"):
        emulated_grouped_gemm(x, w, torch.tensor([4, 2, 6], device=device), q, q)
    with pytest.raises(ValueError, match="end at the number of rows 6, got 5"):
        emulated_grouped_gemm(x, w, torch.tensor([1, 2, 5], device=device), q, q)
    with pytest.raises(TypeError, match="integer tensor"):
        emulated_grouped_gemm(x, w, torch.tensor([1.0, 2.0, 6.0], device=device), q, q)
    with pytest.raises(ValueError, match=r"x\[T, K\] and w\[E, K, N\]"):
        emulated_grouped_gemm(x, w[:, :16], torch.tensor([1, 2, 6], device=device), q, q)
