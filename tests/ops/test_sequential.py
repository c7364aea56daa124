"""Sequential: grouping into fusers, pass-through modules, extra-input and extra-output routing."""

import pytest
import torch

from te_dist import ops


class RowSum(ops.BasicOperation):
    """Test op with an extra output: passes x through and also returns its row sums."""

    num_extra_outputs = 1

    def op_forward(self, ctx, x, extra_inputs, recipe):
        return x.clone(), (x.sum(-1),)

    def op_backward(self, ctx, dy, grad_extra_outputs):
        (g,) = grad_extra_outputs
        return (dy if g is None else dy + g.unsqueeze(-1)), [], ()


def test_groups_and_pass_through_modules():
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8)
    seq = ops.Sequential(ops.BasicLinear(4, 8), ops.Bias(8), ops.GELU(), norm, ops.BasicLinear(8, 3), ops.Bias(3))
    assert len(seq.fusers) == 2 and len(seq) == 6
    assert [len(f.basic_ops) for f in seq.fusers] == [3, 2]
    assert set(seq.state_dict()) == {"0.weight", "1.bias", "3.weight", "3.bias", "4.weight", "5.bias"}
    assert len(list(seq.parameters())) == 6
    x = torch.randn(5, 4, requires_grad=True)
    y = seq(x)
    x_ref = x.detach().clone().requires_grad_(True)
    h = torch.nn.functional.gelu(x_ref @ seq[0].weight.t() + seq[1].bias)
    y_ref = norm(h) @ seq[4].weight.t() + seq[5].bias
    torch.testing.assert_close(y, y_ref)
    y.sum().backward()
    grads = [p.grad.clone() for p in seq.parameters()]
    for p in seq.parameters():
        p.grad = None
    y_ref.sum().backward()
    for g, p in zip(grads, seq.parameters()):
        torch.testing.assert_close(g, p.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_extra_inputs_are_routed_in_order():
    torch.manual_seed(1)
    E, H, F = 3, 8, 4
    fc1, act, fc2 = ops.GroupedLinear(E, H, 2 * F), ops.ScaledSwiGLU(), ops.GroupedLinear(E, F, H)
    tail = ops.GroupedLinear(2, H, H)
    seq = ops.Sequential(fc1, act, fc2, torch.nn.Identity(), tail)
    assert seq.num_extra_inputs == 4
    x = torch.randn(6, H)
    s1, p, s_tail = torch.tensor([1, 2, 3]), torch.rand(6), torch.tensor([4, 2])
    y = seq(x, s1, p, s1, s_tail)
    mlp = ops.OperationFuser([fc1, act, fc2])
    expected = ops.OperationFuser([tail])(mlp(x, s1, p, s1), s_tail)
    torch.testing.assert_close(y, expected)
    assert type(seq.fusers[0].plan.forward_ops[0].op).__name__ == "GroupedMLP"
    with pytest.raises(TypeError, match="expects 4 extra input"):
        seq(x, s1, p)


def test_extra_outputs_are_collected():
    torch.manual_seed(2)
    seq = ops.Sequential(ops.BasicLinear(4, 4), RowSum(), torch.nn.Tanh(), RowSum(), ops.Bias(4))
    assert seq.num_extra_outputs == 2
    x = torch.randn(3, 4, requires_grad=True)
    y, s1, s2 = seq(x)
    h = x @ seq[0].weight.t()
    torch.testing.assert_close(s1, h.sum(-1))
    torch.testing.assert_close(s2, torch.tanh(h).sum(-1))
    (y.sum() + 2 * s1.sum() + 3 * s2.sum()).backward()
    x_ref = x.detach().clone().requires_grad_(True)
    h = x_ref @ seq[0].weight.detach().t()
    t = torch.tanh(h)
    ((t + seq[4].bias.detach()).sum() + 2 * h.sum() + 3 * t.sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_dtype_move_reaches_fused_ops():
    seq = ops.Sequential(ops.BasicLinear(4, 4), ops.Bias(4), ops.ReLU())
    seq.to(torch.float64)
    y = seq(torch.randn(2, 4, dtype=torch.float64))
    assert y.dtype == torch.float64


def test_rejects_non_modules():
    with pytest.raises(TypeError, match="item 1"):
        ops.Sequential(ops.ReLU(), lambda t: t)
