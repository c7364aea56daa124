"""Token rows + probabilities in one payload (te_dist.moe.payload): values and gradients equal the
two separate gathers it replaces, for every dtype pairing the layer uses."""

import pytest
import torch

from te_dist.moe.payload import PROB_BYTES, pack_expand, payload_columns, prob_view, unpack_rows
from te_dist.moe.permutation import inverse_permutation, permute_probs, permute_rows, permute_tokens, sort_by_expert


def _case(x_dtype, probs_dtype, T=9, K=3, E=5, H=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(x_dtype).requires_grad_(True)
    probs = torch.rand(T, K, generator=g, dtype=torch.float64).to(probs_dtype).requires_grad_(True)
    return x, probs, indices


@pytest.mark.parametrize("x_dtype,probs_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                 (torch.float64, torch.float32), (torch.float64, torch.float64)])
def test_pack_unpack_equals_separate_gathers_forward_and_backward(x_dtype, probs_dtype):
    _check_against_separate_gathers(x_dtype, probs_dtype, torch.device("cpu"))


@pytest.mark.gpu
def test_pack_unpack_on_cuda_equals_separate_gathers(cuda_device):
    """The gathers write into / read from strided payload views: the CUDA kernels must honour them."""
    _check_against_separate_gathers(torch.bfloat16, torch.float32, cuda_device, H=7168)


def _check_against_separate_gathers(x_dtype, probs_dtype, device, H=16):
    x, probs, indices = _case(x_dtype, probs_dtype, H=H)
    x, probs, indices = (x.detach().to(device).requires_grad_(True), probs.detach().to(device).requires_grad_(True),
                         indices.to(device))
    S, H = indices.numel(), x.shape[1]
    idx = torch.randperm(S, generator=torch.Generator().manual_seed(1)).to(device)
    inv = inverse_permutation(idx)
    gx = torch.randn(S, H, dtype=torch.float64).to(device, x_dtype)
    gp = torch.randn(S, dtype=torch.float64).to(device, probs_dtype)

    perm = sort_by_expert(x, indices, 5)
    payload = pack_expand(x, permute_probs(probs, perm), perm)
    assert payload.shape == (S, payload_columns(H, x_dtype)) and payload.dtype == x_dtype
    assert (payload.shape[1] - H) * x_dtype.itemsize == PROB_BYTES
    x_N, p_N = unpack_rows(payload, idx, inv, H, probs_dtype)
    assert x_N.is_contiguous() and p_N.dtype == probs_dtype
    dx, dp = torch.autograd.grad((x_N, p_N), (x, probs), (gx, gp))

    x_S, ref_perm = permute_tokens(x, indices, 5)
    ref_x = permute_rows(x_S, idx, inv)
    ref_p = permute_rows(permute_probs(probs, ref_perm), idx, inv)
    ref_dx, ref_dp = torch.autograd.grad((ref_x, ref_p), (x, probs), (gx, gp))
    # bit-exact: the same gathers and the same fixed-order K-sum
    assert torch.equal(x_N, ref_x) and torch.equal(p_N, ref_p)
    assert torch.equal(dx, ref_dx) and torch.equal(dp, ref_dp)


def test_empty_payload_and_only_one_input_needing_grad():
    x, probs, indices = _case(torch.float32, torch.float32, T=0)
    perm = sort_by_expert(x, indices, 5)
    payload = pack_expand(x, permute_probs(probs, perm), perm)
    empty = torch.zeros(0, dtype=torch.int64)
    x_N, p_N = unpack_rows(payload, empty, empty, x.shape[1], torch.float32)
    assert x_N.shape == (0, x.shape[1]) and p_N.shape == (0,)

    x, probs, indices = _case(torch.float32, torch.float32)
    probs = probs.detach()
    perm = sort_by_expert(x, indices, 5)
    payload = pack_expand(x, permute_probs(probs, perm), perm)
    S = indices.numel()
    ident = torch.arange(S)
    x_N, _ = unpack_rows(payload, ident, ident, x.shape[1], torch.float32)
    (dx,) = torch.autograd.grad(x_N.sum(), x)
    torch.testing.assert_close(dx, torch.full_like(x, indices.shape[1]))  # each token copied K times


def test_pack_rejects_wrong_probabilities():
    x, probs, indices = _case(torch.float32, torch.float32)
    perm = sort_by_expert(x, indices, 5)
    with pytest.raises(ValueError, match=r"expected probabilities \[27\]"):
        pack_expand(x, probs.reshape(-1)[:5], perm)
    with pytest.raises(ValueError, match="got shape"):
        pack_expand(x, probs, perm)  # [T, K], not in row order [S]


@pytest.mark.parametrize("x_dtype,probs_dtype", [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_prob_view_reads_the_tail_of_a_payload_or_of_a_tail_block(x_dtype, probs_dtype):
    """The peer-rows transport pulls a payload row into two column blocks, x and the tail
    (te_dist.moe.transports.peer.autograd); the tail block's prob_view holds the probabilities bit-exact."""
    x, probs, indices = _case(x_dtype, probs_dtype)
    _, state = permute_tokens(x.detach(), indices, 5)
    probs_S = permute_probs(probs, state).detach()
    payload = pack_expand(x.detach(), probs_S, state)
    H = x.shape[1]
    tail = payload[:, H:].clone()
    assert tail.shape[1] == PROB_BYTES // x_dtype.itemsize
    assert torch.equal(prob_view(payload, H, probs_dtype), probs_S)
    assert torch.equal(prob_view(tail, 0, probs_dtype), probs_S)
    prob_view(tail, 0, probs_dtype).copy_(2 * probs_S)  # writes land in the tail's first bytes only
    assert torch.equal(prob_view(tail, 0, probs_dtype), 2 * probs_S)
    assert torch.equal(tail.view(torch.uint8)[:, probs_dtype.itemsize:], payload[:, H:].view(torch.uint8)[:, probs_dtype.itemsize:])
