"""CPU tests of te_dist.kernels: the loop path, the torch._grouped_mm path, autograd, validation."""

import pytest
import torch

from te_dist import kernels
from te_dist.gemm import entry as gm
from te_dist.gemm import loop_backend, torch_backend
from te_dist.kernels import grouped_mm, grouped_mm_dgrad, grouped_mm_forward, grouped_mm_wgrad


def _offsets(splits):
    return torch.tensor(splits, dtype=torch.int64).cumsum(0).to(torch.int32)


def _reference(x, w_EKN, splits, bias=None, scale=None):
    """float64 per-expert reference written independently of the backends."""
    outs, start = [], 0
    for e, n in enumerate(splits):
        acc = x[start:start + n].double() @ w_EKN[e].double()
        if scale is not None:
            acc = acc * scale[start:start + n].double()[:, None]
        if bias is not None:
            acc = acc + bias[e].double()
        outs.append(acc)
        start += n
    return torch.cat(outs) if outs else torch.zeros(0, w_EKN.shape[2], dtype=torch.float64)


def _weight(E, K, N, dtype=torch.float32):
    return torch.randn(E, N, K, dtype=dtype).transpose(1, 2)  # [E, K, N] view of [E, out, in]


SPLITS = [[3, 0, 5, 1], [0, 0, 7], [1, 1, 1, 1, 1], [4]]


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_forward_matches_reference(splits, backend):
    torch.manual_seed(0)
    E, K, N, T = len(splits), 16, 8, sum(splits)
    x, w = torch.randn(T, K), _weight(E, K, N)
    bias, scale = torch.randn(E, N), torch.rand(T)
    y = grouped_mm_forward(x, w, _offsets(splits), bias_EN=bias, row_scale_T=scale, backend=backend)
    torch.testing.assert_close(y.double(), _reference(x, w, splits, bias, scale), rtol=1e-5, atol=1e-5)


def test_forward_bf16_epilogue_in_fp32_and_out_dtype():
    torch.manual_seed(1)
    splits = [2, 3, 0]
    x, w = torch.randn(5, 16).bfloat16(), _weight(3, 16, 8, torch.bfloat16)
    y = grouped_mm(x, w, _offsets(splits), out_dtype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _reference(x, w, splits), rtol=1e-5, atol=1e-5)
    assert grouped_mm(x, w, _offsets(splits)).dtype == torch.bfloat16


def test_contiguous_EKN_weight_is_accepted():
    torch.manual_seed(2)
    splits = [2, 2]
    x, w = torch.randn(4, 8), torch.randn(2, 8, 4)  # contiguous [E, K, N]
    y = grouped_mm(x, w, _offsets(splits))
    torch.testing.assert_close(y.double(), _reference(x, w, splits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [[3, 0, 5, 1], [0, 4, 0]])
@pytest.mark.parametrize("with_bias,with_scale", [(False, False), (True, False), (False, True), (True, True)])
def test_autograd_matches_reference(splits, with_bias, with_scale):
    torch.manual_seed(3)
    E, K, N, T = len(splits), 16, 8, sum(splits)
    x = torch.randn(T, K, requires_grad=True)
    w_ENK = torch.randn(E, N, K, requires_grad=True)  # the stored parameter
    bias = torch.randn(E, N, requires_grad=True) if with_bias else None
    scale = torch.rand(T, requires_grad=True) if with_scale else None
    offsets = _offsets(splits)
    y = grouped_mm(x, w_ENK.transpose(1, 2), offsets, bias_EN=bias, row_scale_T=scale)
    dy = torch.randn_like(y)
    y.backward(dy)

    leaves = [x, w_ENK] + [t for t in (bias, scale) if t is not None]
    got = [t.grad.clone() for t in leaves]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rx, rw = ref_leaves[0], ref_leaves[1]
    rest = iter(ref_leaves[2:])
    rb = next(rest) if with_bias else None
    rs = next(rest) if with_scale else None
    _reference(rx, rw.transpose(1, 2), splits, rb, rs).backward(dy.double())
    for g, r in zip(got, ref_leaves):
        torch.testing.assert_close(g.double(), r.grad, rtol=1e-5, atol=1e-5)
    # experts without rows get exactly zero weight (and bias) gradients
    for e, n in enumerate(splits):
        if n == 0:
            assert torch.count_nonzero(w_ENK.grad[e]) == 0
            if with_bias:
                assert torch.count_nonzero(bias.grad[e]) == 0


def test_float64_is_rejected_with_a_clear_error():
    x, w = torch.randn(5, 4, dtype=torch.float64), torch.randn(3, 4, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match="x_TK.dtype must be one of"):
        grouped_mm(x, w, _offsets([2, 0, 3]))


@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_dgrad_and_wgrad_entry_points(backend):
    torch.manual_seed(5)
    splits = [3, 0, 2]
    E, K, N, T = 3, 16, 8, 5
    x, w, dy, s = torch.randn(T, K), _weight(E, K, N), torch.randn(T, N), torch.rand(T)
    offsets = _offsets(splits)
    dx = grouped_mm_dgrad(dy, w, offsets, row_scale_T=s, backend=backend)
    ref_dx = _reference(dy, w.transpose(1, 2), splits, None, s)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=1e-5, atol=1e-5)
    dw = grouped_mm_wgrad(x, dy, offsets, backend=backend)
    assert dw.shape == (E, K, N)
    assert dw.transpose(1, 2).is_contiguous(), "wgrad must be written in the weight's [E, N, K] layout"
    start = 0
    for e, n in enumerate(splits):
        torch.testing.assert_close(dw[e].double(), x[start:start + n].double().t() @ dy[start:start + n].double(),
                                   rtol=1e-5, atol=1e-5)
        start += n


def test_zero_rows_total():
    x, w = torch.zeros(0, 8), _weight(2, 8, 8)
    y = grouped_mm(x, w, _offsets([0, 0]))
    assert y.shape == (0, 8)


# --------------------------------------------------------------------------- validation


def test_validation_errors_name_expected_and_received():
    x, w = torch.randn(5, 8), _weight(2, 8, 4)
    good = _offsets([2, 3])
    with pytest.raises(TypeError, match="int32"):
        grouped_mm(x, w, good.long())
    with pytest.raises(ValueError, match="2 experts"):
        grouped_mm(x, w, _offsets([5]))
    with pytest.raises(ValueError, match=r"offsets_E\[-1\]=4 != num_rows=5"):
        grouped_mm(x, w, _offsets([2, 2]))
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mm(x, w, torch.tensor([4, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="K=6"):
        grouped_mm(torch.randn(5, 6), w, good)
    with pytest.raises(TypeError, match="w_EKN.dtype"):
        grouped_mm(x, w.double(), good)
    with pytest.raises(TypeError, match="x_TK.dtype"):
        grouped_mm(x.to(torch.int32), w, good)
    with pytest.raises(ValueError, match=r"bias_EN must have shape \(2, 4\)"):
        grouped_mm(x, w, good, bias_EN=torch.randn(2, 5))
    with pytest.raises(ValueError, match="row_scale_T must have T=5"):
        grouped_mm(x, w, good, row_scale_T=torch.rand(4))
    with pytest.raises(ValueError, match="backend must be"):
        grouped_mm(x, w, good, backend="cublas")
    with pytest.raises(ValueError, match="needs CUDA"):
        grouped_mm(x, w, good, backend="cutlass")
    with pytest.raises(ValueError, match="3-D"):
        grouped_mm(x, w[0], good)


def test_validation_happens_before_any_work(monkeypatch):
    calls = []
    monkeypatch.setattr(loop_backend, "forward", lambda *a, **k: calls.append(a))
    with pytest.raises(ValueError):
        grouped_mm(torch.randn(5, 8), _weight(2, 8, 4), _offsets([2, 2]))
    assert calls == []


@pytest.mark.parametrize("backend", ["torch", "loop", None])  # (None: the CPU rule's loop, remembered too)
def test_a_call_like_a_checked_one_skips_the_checks_but_still_checks_its_rows(monkeypatch, backend):
    """grouped_mm_forward remembers the facts a call was checked on: a like call (other rows, other
    offsets) is not checked again, but its row scale, offsets' values and host sizes are, worded alike."""
    from te_dist.gemm import validation

    x, w, scale, bias = torch.randn(5, 8), _weight(2, 8, 4), torch.rand(5), torch.randn(2, 4)
    for kw in ({}, {"row_scale_T": scale, "bias_EN": bias, "group_sizes": (2, 3)}):
        want = grouped_mm_forward(x, w, _offsets([2, 3]), backend=backend, **kw)
        checked = []
        real = validation.check_forward
        monkeypatch.setattr(validation, "check_forward", lambda *a: checked.append(a) or real(*a))
        x2 = torch.randn(7, 8)
        got = grouped_mm_forward(x, w, _offsets([2, 3]), backend=backend, **kw)
        assert torch.equal(got, want) and checked == []
        sizes = {"group_sizes": (4, 3)} if "group_sizes" in kw else {}
        y2 = grouped_mm_forward(x2, w, _offsets([4, 3]), backend=backend, **{**kw, "row_scale_T": None, **sizes})
        assert torch.allclose(y2, _reference(x2, w, [4, 3], bias=kw.get("bias_EN")).float(), atol=1e-4)
        with pytest.raises(ValueError, match=r"offsets_E\[-1\]=4 != num_rows=5"):
            grouped_mm_forward(x, w, _offsets([2, 2]), backend=backend, **kw)
        with pytest.raises(ValueError, match="non-decreasing"):
            grouped_mm_forward(x, w, torch.tensor([4, 2], dtype=torch.int32), backend=backend, **kw)
        if kw:
            with pytest.raises(ValueError, match="row_scale_T must have T=7"):
                grouped_mm_forward(x2, w, _offsets([4, 3]), backend=backend, **{**kw, **sizes, "row_scale_T": scale})
            with pytest.raises(ValueError, match="group_sizes sum to 4"):
                grouped_mm_forward(x, w, _offsets([2, 3]), backend=backend, **{**kw, "group_sizes": (2, 2)})
        monkeypatch.undo()


def test_available_backends_cpu():
    assert kernels.available_backends("cpu") == ["loop"]
    x, w = torch.randn(4, 8), _weight(2, 8, 8)
    assert kernels.select_backend("fwd", x, w) == "loop"
    assert kernels.select_backend("fwd", x, w, backend="torch") == "torch"


@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
def test_torch_path_hands_a_transposed_weight_view_to_torch_as_given(monkeypatch, direction):
    """The layer passes ``w.transpose(1, 2)`` of its contiguous [E, N, K] weight: torch._grouped_mm must
    receive that storage as is (same data pointer, no contiguous copy), and the activations as given."""
    seen = []
    real = torch._grouped_mm

    def spy(a, b, offs=None, **kw):
        seen.append((a, b))
        return real(a, b, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    torch.manual_seed(0)
    E, K, N, splits = 3, 16, 8, [4, 0, 4]
    w_ENK = torch.randn(E, N, K)
    x, dy = torch.randn(8, K), torch.randn(8, N)
    off = _offsets(splits)
    if direction == "fwd":
        grouped_mm_forward(x, w_ENK.transpose(1, 2), off, backend="torch")
        a, b = seen[-1]
        assert a is x and b.data_ptr() == w_ENK.data_ptr() and b.stride() == w_ENK.transpose(1, 2).stride()
    elif direction == "dgrad":
        grouped_mm_dgrad(dy, w_ENK.transpose(1, 2), off, backend="torch")
        a, b = seen[-1]
        assert a is dy and b.data_ptr() == w_ENK.data_ptr() and b.is_contiguous()
    else:
        grouped_mm_wgrad(x, dy, off, backend="torch")
        a, b = seen[-1]
        assert a.data_ptr() == dy.data_ptr() and b is x
    assert len(seen) == 1


def test_autograd_through_the_torch_path_copies_no_weight(monkeypatch):
    """Forward and backward of grouped_mm with a transposed-view weight: every torch._grouped_mm call
    reads the parameter's own storage, and no [E, N, K]-sized tensor is allocated besides the gradient."""
    ptrs = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs=None: ptrs.append((a.data_ptr(), b.data_ptr()))
                        or real(a, b, offs=offs))
    w_ENK = torch.randn(3, 8, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    y = grouped_mm(x, w_ENK.transpose(1, 2), _offsets([4, 0, 4]), backend="torch")
    y.backward(torch.randn_like(y))
    assert ptrs[0][1] == w_ENK.data_ptr() and ptrs[1][1] == w_ENK.data_ptr()  # forward and dgrad
    assert len(ptrs) == 3 and w_ENK.grad.shape == w_ENK.shape


@pytest.mark.parametrize("ends", [[16, 16, 40, 64], [3, 3, 9, 13]])
def test_torch_backend_accepts_expanded_gradients(ends):
    """``y.sum().backward()`` hands dgrad/wgrad a zero-stride gradient; torch._grouped_mm rejects
    that layout, so the backend must copy it (seen as a failure on H200 before the fix), in an order
    torch takes also where the rows (13 of them) do not span whole 16 bytes."""
    import te_dist.kernels as K

    torch.manual_seed(0)
    x = torch.randn(ends[-1], 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor(ends, dtype=torch.int32)
    grads = {}
    for backend in ("torch", "loop"):
        x.grad = w.grad = None
        K.grouped_mm(x, w.transpose(1, 2), offs, backend=backend).sum().backward()
        grads[backend] = (x.grad.clone(), w.grad.clone())
    for a, b in zip(grads["torch"], grads["loop"]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


# --------------------------------------------------------------------------- host group sizes


def test_group_sizes_give_the_same_results_forward_and_backward(monkeypatch):
    monkeypatch.setattr(loop_backend, "_use_native", lambda *a: False)  # the per-expert Python loop
    torch.manual_seed(7)
    splits = [3, 0, 2, 4]
    E, K, N, T = 4, 8, 6, 9
    offsets = _offsets(splits)
    x, w, s, b = torch.randn(T, K), _weight(E, K, N), torch.rand(T), torch.randn(E, N)
    outs = []
    for sizes in (None, splits, tuple(splits), torch.tensor(splits)):
        xs, ws, ss, bs = (t.detach().clone().requires_grad_(True) for t in (x, w, s, b))
        y = grouped_mm(xs, ws, offsets, bias_EN=bs, row_scale_T=ss, group_sizes=sizes)
        y.backward(torch.ones_like(y))
        outs.append([y, xs.grad, ws.grad, ss.grad, bs.grad])
    for got in outs[1:]:
        for a, ref in zip(got, outs[0]):
            torch.testing.assert_close(a, ref, rtol=0, atol=0)
    torch.testing.assert_close(outs[0][0].double(), _reference(x, w, splits, b, s), rtol=1e-5, atol=1e-5)


def test_loop_bounds_come_from_group_sizes_without_reading_offsets():
    from te_dist.gemm.loop_backend import expert_rows

    assert expert_rows(None, (2, 0, 3)) == [(0, 2), (2, 2), (2, 5)]
    assert expert_rows(None, torch.tensor([2, 0, 3])) == [(0, 2), (2, 2), (2, 5)]
    assert expert_rows(_offsets([2, 0, 3])) == [(0, 2), (2, 2), (2, 5)]


def test_loop_wgrad_zeroes_experts_without_rows(monkeypatch):
    monkeypatch.setattr(loop_backend, "_use_native", lambda *a: False)
    x, dy = torch.randn(4, 8), torch.randn(4, 6)
    dw = grouped_mm_wgrad(x, dy, _offsets([0, 4, 0]), group_sizes=[0, 4, 0], backend="loop")
    assert torch.count_nonzero(dw[0]) == 0 and torch.count_nonzero(dw[2]) == 0
    torch.testing.assert_close(dw[1], x.t() @ dy)


def test_group_sizes_validation_names_expected_and_received():
    x, w = torch.randn(5, 8), _weight(2, 8, 4)
    good = _offsets([2, 3])
    with pytest.raises(ValueError, match="group_sizes has 3 entries but there are 2 experts"):
        grouped_mm(x, w, good, group_sizes=[2, 3, 0])
    with pytest.raises(ValueError, match="non-negative"):
        grouped_mm_forward(x, w, good, group_sizes=[6, -1])
    with pytest.raises(ValueError, match="sum to 4 but there are 5 rows"):
        grouped_mm_dgrad(torch.randn(5, 4), w, good, group_sizes=[2, 2])
    with pytest.raises(TypeError, match="list or tuple of ints"):
        grouped_mm_wgrad(x, torch.randn(5, 4), good, group_sizes=[2.0, 3.0])
    with pytest.raises(TypeError, match="list or tuple of ints"):
        grouped_mm(x, w, good, group_sizes="23")


def test_host_group_sizes_reach_the_cutlass_tile_choice(monkeypatch, request):
    """The CUTLASS tile table reads the host sizes (its ragged row), so forward and dgrad, also the
    dgrad of the autograd backward, hand them on; wgrad has no size-dependent tile."""
    seen = []

    class RecordingCutlass:  # stands in for cutlass_backend; the math runs on the loop backend
        @staticmethod
        def forward(x, w, off, bias, scale, out_dtype, group_sizes=None, *, config=None):
            seen.append(("fwd", group_sizes))
            return loop_backend.forward(x, w, off, bias, scale, out_dtype)

        @staticmethod
        def dgrad(dy, w, off, scale, out_dtype, group_sizes=None, *, config=None):
            seen.append(("dgrad", group_sizes))
            return loop_backend.dgrad(dy, w, off, scale, out_dtype)

        @staticmethod
        def wgrad(x, dy, off, num_groups, out_dtype, group_sizes=None, *, config=None):
            seen.append(("wgrad", None))
            return loop_backend.wgrad(x, dy, off, num_groups, out_dtype)

    monkeypatch.setattr(gm, "cutlass_backend", RecordingCutlass)
    monkeypatch.setattr(gm.decide, "why_not", lambda *a, **k: None)  # "cutlass can run this call"
    request.addfinalizer(gm.measure.reset)  # the tuner remembers the patched rule's choices: not past this test
    splits = [3, 0, 5]
    x = torch.randn(8, 4, requires_grad=True)
    w = _weight(3, 4, 6).detach().clone().requires_grad_(True)
    y = grouped_mm(x, w, _offsets(splits), group_sizes=splits, backend="cutlass")
    y.backward(torch.ones_like(y))
    assert seen == [("fwd", (3, 0, 5)), ("dgrad", (3, 0, 5)), ("wgrad", None)]
    torch.testing.assert_close(y.double(), _reference(x.detach(), w.detach(), splits), rtol=1e-5, atol=1e-5)
    grouped_mm_forward(x.detach(), w.detach(), _offsets(splits), backend="cutlass")
    assert seen[-1] == ("fwd", None)
