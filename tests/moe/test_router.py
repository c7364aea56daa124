"""Router: score functions, selection-only expert bias, normalisation, auxiliary losses, errors."""

import pytest
import torch

from te_dist.moe.router import TopKRouter, load_balancing_loss, z_loss


def _router(**kw):
    torch.manual_seed(0)
    return TopKRouter(8, 6, 2, **kw)


def test_softmax_post_topk_matches_reference():
    r = _router()
    x = torch.randn(5, 8)
    out = r(x)
    logits = x @ r.weight.t()
    top, idx = logits.topk(2, dim=-1)
    assert torch.equal(out.indices_TK, idx)
    torch.testing.assert_close(out.probs_TK, torch.softmax(top, -1))
    torch.testing.assert_close(out.probs_TK.sum(-1), torch.ones(5))


def test_softmax_pre_topk_not_normalised_by_default():
    r = _router(pre_softmax=True)
    x = torch.randn(5, 8)
    out = r(x)
    scores = torch.softmax(x @ r.weight.t(), -1)
    p, idx = scores.topk(2, dim=-1)
    assert torch.equal(out.indices_TK, idx)
    torch.testing.assert_close(out.probs_TK, p)
    assert (out.probs_TK.sum(-1) < 1).all()
    normed = _router(pre_softmax=True, normalize=True)(x)
    torch.testing.assert_close(normed.probs_TK, p / p.sum(-1, keepdim=True))


def test_sigmoid_expert_bias_changes_selection_not_weights():
    r = _router(score_function="sigmoid", expert_bias=True, normalize=False)
    x = torch.randn(9, 8)
    scores = torch.sigmoid(x @ r.weight.t())
    r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 10.0]))  # force expert 5 into every top-2
    out = r(x)
    assert (out.indices_TK == 5).any(dim=-1).all()
    torch.testing.assert_close(out.probs_TK, scores.gather(-1, out.indices_TK))  # unbiased scores


def test_update_expert_bias_raises_underloaded():
    r = _router(score_function="sigmoid", expert_bias=True)
    r.update_expert_bias(torch.tensor([10, 0, 5, 5, 5, 5]), rate=0.5)
    assert r.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0, 0.0, 0.0]


def test_aux_losses_values_and_gradient_flow():
    r = _router(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = torch.randn(12, 8)
    out = r(x)
    logits = x @ r.weight.t()
    scores = torch.softmax(logits, -1)
    f = torch.bincount(out.indices_TK.flatten(), minlength=6).float() / 24
    torch.testing.assert_close(out.aux_loss, 0.1 * 6 * (f * scores.mean(0)).sum())
    torch.testing.assert_close(out.z_loss, 0.01 * torch.logsumexp(logits, -1).square().mean())
    # backward of the probabilities also trains the gate through both losses
    (g_with,) = torch.autograd.grad(out.probs_TK.sum() * 0.0, r.weight)
    w = r.weight.detach().clone().requires_grad_(True)
    lg = x @ w.t()
    top_idx = lg.topk(2, -1).indices
    ref = 0.1 * load_balancing_loss(torch.softmax(lg, -1), top_idx, 6) + 0.01 * z_loss(lg)
    (g_ref,) = torch.autograd.grad(ref, w)
    torch.testing.assert_close(g_with, g_ref)
    assert g_ref.abs().sum() > 0


def test_balanced_loss_is_one():
    scores = torch.full((4, 4), 0.25)
    idx = torch.tensor([[0], [1], [2], [3]])
    torch.testing.assert_close(load_balancing_loss(scores, idx, 4), torch.tensor(1.0))


def test_errors():
    with pytest.raises(ValueError, match="top_k"):
        TopKRouter(8, 4, 5)
    with pytest.raises(ValueError, match="score_function"):
        TopKRouter(8, 4, 2, score_function="relu")
    with pytest.raises(ValueError, match="expert_bias"):
        TopKRouter(8, 4, 2, expert_bias=True)
    r = _router()
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        r(x)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
def test_non_finite_logits_raise(bad):
    r = _router()
    x = torch.randn(3, 8)
    x[1, :] = 0.0
    x[1, 2] = bad  # one infinite feature: every logit of that token is +-inf, none is NaN
    logits = r.logits(x)
    assert torch.isinf(logits[1]).all() and not torch.isnan(logits).any()  # what a NaN-only check let through
    with pytest.raises(ValueError, match="router logits contain NaN or inf"):
        r(x)
    assert r(x, check_finite=False).logits_TE.shape == (3, 6)  # the caller's own check (MoELayer) instead
