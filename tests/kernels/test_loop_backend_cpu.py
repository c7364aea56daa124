"""The CPU loop backend's two paths: torch._grouped_mm's C++ per-expert loop (16-byte rows) and the
Python loop (any layout, old torch). Both run one ``mm`` per expert, so they must agree, and the
C++ loop must be the one taken whenever the layout allows it."""

import pytest
import torch

from te_dist import kernels
from te_dist.gemm import epilogue, loop_backend, torch_backend, validation

NATIVE = loop_backend._cpu_grouped_mm_available()
needs_native = pytest.mark.skipif(not NATIVE, reason="this torch has no CPU torch._grouped_mm")


def _offsets(splits):
    return torch.tensor(splits, dtype=torch.int64).cumsum(0).to(torch.int32)


def _python_loop(monkeypatch):
    monkeypatch.setattr(loop_backend, "_cpu_grouped_mm_available", lambda: False)


def _all_directions(x, w, dy, offsets, bias, scale, out_dtype):
    E = w.shape[0]
    return (
        loop_backend.forward(x, w, offsets, bias, scale, out_dtype),
        loop_backend.dgrad(dy, w, offsets, scale, out_dtype),
        loop_backend.wgrad(x, dy, offsets, E, out_dtype),
    )


# (splits, K, N): the first three have K and N multiples of 4 (C++ loop), the others do not.
CASES = [([3, 0, 5, 1], 16, 8), ([0, 0, 7], 12, 20), ([4], 8, 4), ([2, 3, 0], 6, 5), ([1, 1, 1, 1, 1], 16, 6)]


@pytest.mark.parametrize("splits,K,N", CASES)
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.bfloat16, torch.float32), (torch.float16, None)])
def test_cpp_and_python_loops_agree(monkeypatch, splits, K, N, dtype, out_dtype):
    torch.manual_seed(0)
    E, T = len(splits), sum(splits)
    x = torch.randn(T, K).to(dtype)
    w = torch.randn(E, N, K).to(dtype).transpose(1, 2)  # [E, K, N] view of the [E, out, in] weight
    dy = torch.randn(T, N).to(dtype)
    bias, scale = torch.randn(E, N).to(dtype), torch.rand(T)
    offsets = _offsets(splits)
    got = _all_directions(x, w, dy, offsets, bias, scale, out_dtype)
    _python_loop(monkeypatch)
    want = _all_directions(x, w, dy, offsets, bias, scale, out_dtype)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape and g.stride() == r.stride()
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    dw = got[2]
    assert dw.transpose(1, 2).is_contiguous(), "wgrad must be written in the weight's [E, N, K] layout"
    for e, n in enumerate(splits):
        if n == 0:
            assert torch.count_nonzero(dw[e]) == 0


@needs_native
@pytest.mark.parametrize("splits,K,N,native", [(s, k, n, k % 4 == 0 and n % 4 == 0) for s, k, n in CASES])
def test_cpp_loop_taken_when_rows_are_16_byte_aligned(monkeypatch, splits, K, N, native):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    E, T = len(splits), sum(splits)
    x, w, dy = torch.randn(T, K), torch.randn(E, N, K).transpose(1, 2), torch.randn(T, N)
    _all_directions(x, w, dy, _offsets(splits), None, None, None)
    assert len(calls) == (3 if native else 0)


@needs_native
def test_expanded_and_strided_operands(monkeypatch):
    """``y.sum().backward()`` hands dgrad/wgrad a zero-stride gradient, and sliced inputs have row
    strides the C++ loop refuses: both must give the Python loop's results."""
    torch.manual_seed(1)
    splits, K, N = [5, 0, 3], 8, 12
    E, T = len(splits), sum(splits)
    offsets, scale = _offsets(splits), torch.rand(T)
    dy = torch.randn(1, N).expand(T, N)
    x = torch.randn(T, K + 2)[:, 1:K + 1]  # row stride K + 2: not a multiple of 4
    w = torch.randn(E, N, K).transpose(1, 2)
    got = _all_directions(x, w, dy, offsets, None, scale, None)
    _python_loop(monkeypatch)
    want = _all_directions(x, w, dy, offsets, None, scale, None)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


@needs_native
def test_layout_rule_matches_what_torch_accepts():
    """The torch backend's layout rule (``_aligned``, which the C++ loop runs through too) must
    accept exactly the layouts torch._grouped_mm takes, and its copy of a refused one must be taken:
    a refused layout would raise inside the kernel, a missed one would cost a copy per call."""
    import itertools

    checked = 0
    for T, K in itertools.product([1, 2, 3, 4, 5, 8], [1, 2, 3, 4, 5, 8]):
        layouts = [torch.randn(T, K), torch.randn(K, T).t(), torch.randn(T, K + 3)[:, :K],
                   torch.randn(1, K).expand(T, K), torch.randn(T, 1).expand(T, K),
                   torch.randn(2 * T, K)[::2], torch.randn(T, 2 * K)[:, ::2]]
        for a in layouts:
            try:
                torch._grouped_mm(a, torch.randn(1, K, 4), offs=torch.tensor([T], dtype=torch.int32))
                accepted = True
            except RuntimeError:
                accepted = False
            copy = torch_backend._aligned(a)
            assert (copy is a) == accepted, (tuple(a.shape), a.stride())
            if K % 4 == 0 or T % 4 == 0:  # rows or columns of whole 16 bytes: a dense copy that torch takes
                torch._grouped_mm(copy, torch.randn(1, K, 4), offs=torch.tensor([T], dtype=torch.int32))
            checked += 1
    assert checked == 252


def test_validate_false_skips_only_the_checks(monkeypatch):
    torch.manual_seed(2)
    splits, K, N = [2, 0, 3], 8, 4
    T = sum(splits)
    x, w, dy, offsets = torch.randn(T, K), torch.randn(3, N, K).transpose(1, 2), torch.randn(T, N), _offsets(splits)
    want_dx = kernels.grouped_mm_dgrad(dy, w, offsets)
    want_dw = kernels.grouped_mm_wgrad(x, dy, offsets)

    def refuse(*args, **kwargs):
        raise AssertionError("validation ran with validate=False")

    monkeypatch.setattr(validation, "check_dgrad", refuse)
    monkeypatch.setattr(validation, "check_wgrad", refuse)
    assert torch.equal(kernels.grouped_mm_dgrad(dy, w, offsets, validate=False), want_dx)
    assert torch.equal(kernels.grouped_mm_wgrad(x, dy, offsets, validate=False), want_dw)
    with pytest.raises(AssertionError, match="validation ran"):  # a fact unlike the checked call's: checked
        kernels.grouped_mm_dgrad(dy, w, offsets, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16])
def test_epilogue_consumes_a_float32_accumulator_in_place(acc_dtype):
    torch.manual_seed(3)
    offsets = _offsets([2, 0, 3])
    acc = torch.randn(5, 4).to(acc_dtype)
    bias, scale = torch.randn(3, 4), torch.rand(5, dtype=torch.bfloat16)
    expected = acc.double() * scale.double()[:, None] + bias.double()[torch.tensor([0, 0, 2, 2, 2])]
    before = acc.clone()
    out = epilogue.apply_epilogue(acc, offsets, bias, scale, torch.float32)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2 if acc_dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    if acc_dtype == torch.float32:
        assert out.data_ptr() == acc.data_ptr()  # no extra buffer
    else:
        assert torch.equal(acc, before)  # a low-precision accumulator is left alone


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_row_scale_alone_is_one_pass_in_place_rounded_once(scale_dtype):
    """bf16 accumulator, bf16 out, no bias: scaled in place, product in float32, one rounding."""
    torch.manual_seed(4)
    acc = torch.randn(6, 5).bfloat16()
    scale = torch.rand(6).to(scale_dtype)
    want = (acc.float() * scale.float()[:, None]).bfloat16()
    out = epilogue.apply_epilogue(acc, _offsets([4, 2]), None, scale, torch.bfloat16)
    assert out.data_ptr() == acc.data_ptr()
    assert torch.equal(out, want)
