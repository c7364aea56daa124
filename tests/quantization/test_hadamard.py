"""Random Hadamard transform: structure, documented seed, orthogonality, inversion, product invariance."""

import pytest
import torch

from te_dist.quantization.hadamard import RHT_SEED, apply_rht, hadamard_matrix, invert_rht, rht_matrix


def test_sylvester_hadamard_structure():
    h = hadamard_matrix(16)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h @ h.T, 16 * torch.eye(16))
    assert torch.equal(h[0], torch.ones(16))  # Sylvester: first row all ones
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)


def test_signs_follow_the_documented_seed():
    g = torch.Generator(device="cpu").manual_seed(RHT_SEED)
    signs = 1.0 - 2.0 * torch.randint(0, 2, (16,), generator=g).to(torch.float32)
    expected = signs[:, None] * hadamard_matrix(16) / 4.0
    assert torch.equal(rht_matrix("cpu"), expected)
    assert (signs == -1).any() and (signs == 1).any()  # really random signs, not the plain matrix


def test_rht_matrix_is_orthogonal(device):
    t = rht_matrix(device)
    torch.testing.assert_close(t @ t.T, torch.eye(16, device=device), rtol=0, atol=1e-6)
    torch.testing.assert_close(t.T @ t, torch.eye(16, device=device), rtol=0, atol=1e-6)


def test_apply_then_invert_is_identity(device):
    x = torch.randn(8, 64, device=device)
    y = apply_rht(x)
    assert not torch.allclose(y, x)
    torch.testing.assert_close(invert_rht(y), x, rtol=0, atol=1e-5)
    # norms of every 16-element run are preserved
    torch.testing.assert_close(y.reshape(8, 4, 16).norm(dim=-1), x.reshape(8, 4, 16).norm(dim=-1))


def test_transform_cancels_in_a_product(device):
    a = torch.randn(5, 32, device=device)
    b = torch.randn(7, 32, device=device)
    torch.testing.assert_close(apply_rht(a) @ apply_rht(b).T, a @ b.T, rtol=1e-5, atol=1e-5)


def test_outlier_is_spread_over_the_block(device):
    x = torch.zeros(1, 16, device=device)
    x[0, 3] = 100.0
    y = apply_rht(x)
    assert torch.equal(y.abs(), torch.full_like(y, 25.0))


def test_rejects_length_not_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        apply_rht(torch.zeros(2, 24))
