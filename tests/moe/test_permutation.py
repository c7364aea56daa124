"""Permutation by global expert and its inverse, chunk re-sorting after the all-to-all."""

import pytest
import torch

from te_dist.moe.permutation import (
    chunk_sort_index,
    chunk_unsort_index,
    permute_probs,
    permute_rows,
    permute_tokens,
    unpermute_rows,
    unpermute_tokens,
)


def _routing(T=7, K=3, E=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    x = torch.randn(T, 4, generator=g, dtype=torch.float64)
    probs = torch.rand(T, K, generator=g, dtype=torch.float64)
    return x, indices, probs


def test_permute_is_stable_sort_by_expert():
    x, indices, _ = _routing()
    T, K = indices.shape
    x_S, state = permute_tokens(x, indices, 5)
    expected_rows = []
    for e in range(5):
        for t in range(T):
            for k in range(K):
                if indices[t, k] == e:
                    expected_rows.append(x[t])
    torch.testing.assert_close(x_S, torch.stack(expected_rows), rtol=0, atol=0)
    assert state.counts_E.tolist() == torch.bincount(indices.flatten(), minlength=5).tolist()


def test_unpermute_restores_and_weights_by_probs():
    x, indices, probs = _routing()
    x_S, state = permute_tokens(x, indices, 5)
    # identity experts: each token returns K copies of itself, weighted sum = x * sum(probs)
    torch.testing.assert_close(unpermute_tokens(x_S, state), x * indices.shape[1])
    torch.testing.assert_close(unpermute_tokens(x_S, state, probs), x * probs.sum(1, keepdim=True))
    # per-expert scaling is visible after unpermute in the right token slots
    scale_S = (indices.flatten()[state.sort_idx_S] + 1).double()
    y = unpermute_tokens(x_S * scale_S[:, None], state, probs)
    torch.testing.assert_close(y, x * (probs * (indices + 1)).sum(1, keepdim=True))
    torch.testing.assert_close(permute_probs(probs, state), probs.flatten()[state.sort_idx_S])


def test_permutation_gradients_match_autograd_reference():
    x, indices, probs = _routing(T=6, K=2, E=4, seed=3)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    w = torch.randn(4, 4, 4, dtype=torch.float64)
    x_S, state = permute_tokens(x, indices, 4)
    e_S = indices.flatten()[state.sort_idx_S]
    y_S = torch.einsum("sh,shn->sn", x_S, w[e_S])
    out = unpermute_tokens(y_S, state, probs)
    ref = torch.einsum("tkh,tkhn,tk->tn", x.unsqueeze(1).expand(-1, 2, -1), w[indices], probs)
    torch.testing.assert_close(out, ref)
    gx, gp = torch.autograd.grad((out * out).sum(), (x, probs))
    rx, rp = torch.autograd.grad((ref * ref).sum(), (x, probs))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gp, rp)


def test_empty_tokens_and_unused_experts():
    x = torch.zeros(0, 4, requires_grad=True)
    indices = torch.zeros(0, 2, dtype=torch.int64)
    x_S, state = permute_tokens(x, indices, 3)
    assert x_S.shape == (0, 4) and state.counts_E.tolist() == [0, 0, 0]
    out = unpermute_tokens(x_S * 2, state, torch.zeros(0, 2))
    out.sum().backward()
    assert out.shape == (0, 4) and x.grad.shape == (0, 4)


def test_permute_rows_round_trip_and_grad():
    x = torch.randn(5, 3, requires_grad=True)
    idx = torch.tensor([3, 0, 4, 1, 2])
    y = permute_rows(x, idx)
    torch.testing.assert_close(y, x[idx])
    torch.testing.assert_close(unpermute_rows(y, idx), x)
    g = torch.randn(5, 3)
    (gx,) = torch.autograd.grad(y, x, g)
    ref = torch.zeros(5, 3)
    ref[idx] = g
    torch.testing.assert_close(gx, ref)


def test_chunk_sort_index_reorders_rank_major_to_expert_major():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [R=2, El=3]
    # arrival rows labelled (rank, expert)
    labels = []
    for r in range(2):
        for e in range(3):
            labels += [(r, e)] * int(counts[r, e])
    idx = chunk_sort_index(counts, int(counts.sum()))
    got = [labels[i] for i in idx.tolist()]
    assert got == sorted(labels, key=lambda re: (re[1], re[0]))
    assert sorted(idx.tolist()) == list(range(len(labels)))
    # row order within a chunk is preserved
    assert idx.tolist() == [0, 1, 3, 4, 5, 6, 2]


@pytest.mark.parametrize("ranks,local", [(1, 1), (2, 3), (4, 8), (3, 1)])
def test_chunk_indices_from_an_upper_bound_of_the_row_count(ranks, local):
    """The dispatcher builds both indices before the host knows the total: any bound >= the total
    gives the exact permutation and its inverse in the first `total` entries (zero chunks too)."""
    g = torch.Generator().manual_seed(ranks * 10 + local)
    for trial in range(10):
        counts = torch.zeros(ranks, local, dtype=torch.int64) if trial == 0 else torch.randint(0, 4, (ranks, local), generator=g)
        total = int(counts.sum())
        labels = [(r, e, j) for r in range(ranks) for e in range(local) for j in range(int(counts[r, e]))]
        for bound in (total, total + 1, 3 * total + 5):
            idx = chunk_sort_index(counts, bound)[:total]
            inv = chunk_unsort_index(counts, bound)[:total]
            assert [labels[i] for i in idx.tolist()] == sorted(labels, key=lambda x: (x[1], x[0], x[2]))
            assert torch.equal(idx[inv], torch.arange(total)) and torch.equal(inv[idx], torch.arange(total))


def test_inverse_permutation_and_gather_sum_match_references():
    from te_dist.moe.permutation import gather_sum, inverse_permutation

    g = torch.Generator().manual_seed(3)
    idx = torch.randperm(12, generator=g)
    inv = inverse_permutation(idx)
    assert torch.equal(idx[inv], torch.arange(12)) and torch.equal(inv[idx], torch.arange(12))
    for dtype in (torch.float64, torch.bfloat16):
        for K in (1, 2, 3, 4):
            y = torch.randn(12, 5, generator=g).to(dtype)
            out = gather_sum(y[: 12 // K * K], inverse_permutation(idx[idx < 12 // K * K]), K)
            rows = y[: 12 // K * K][inverse_permutation(idx[idx < 12 // K * K])].double()
            ref = rows.view(-1, K, 5).sum(1).to(dtype)
            assert out.dtype == dtype and out.shape == (12 // K, 5)
            torch.testing.assert_close(out, ref, rtol=0, atol=0 if dtype == torch.float64 and K <= 2 else 1e-2)


def test_unpermute_without_probs_gradient_is_the_expand_gather():
    x, indices, _ = _routing(T=6, K=2, E=4, seed=5)
    x_S, state = permute_tokens(x, indices, 4)
    y_S = torch.randn_like(x_S, requires_grad=True)
    out = unpermute_tokens(y_S, state)
    g = torch.randn_like(out)
    out.backward(g)
    ref = torch.zeros_like(x_S)
    ref[state.inverse_S] = g.repeat_interleave(2, dim=0)  # flat slot t*K+k sits at permuted row inverse_S
    torch.testing.assert_close(y_S.grad, ref, rtol=0, atol=0)
