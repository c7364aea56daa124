"""Measured choices on a GPU: a tuned call computes what the untuned one does, on every candidate.

Different kernels sum in different orders, so values agree to bf16 rounding, checked against the
float32 loop reference with the same tolerance for both.
"""

from __future__ import annotations

import pytest
import torch

from te_dist import kernels, settings
from te_dist.gemm import entry, loop_backend, measure

pytestmark = pytest.mark.gpu


@pytest.fixture
def fresh_tuner(tmp_path):
    tuner = measure.reset()
    measure.configure(directory=tmp_path, bucket_ms=200, total_ms=float("inf"))
    with settings.override(tune=True):
        yield tuner
    measure.reset()


def _operands(direction, ragged, device):
    from te_dist.tune import zipf_splits

    E, m, K, N = 8, 96, 2880, 768  # K not a multiple of 128 (gpt-oss-like)
    sizes = zipf_splits(E, m) if ragged else [m] * E
    T = sum(sizes)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, K, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(E, N, K, generator=g) / K ** 0.5).to(device, torch.bfloat16).transpose(1, 2)
    dy = torch.randn(T, N, generator=g).to(device, torch.bfloat16)
    off = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    return x, w, dy, off, sizes


def _call(direction, x, w, dy, off, sizes, **kw):
    if direction == "fwd":
        return kernels.grouped_mm_forward(x, w, off, group_sizes=sizes, **kw)
    if direction == "dgrad":
        return kernels.grouped_mm_dgrad(dy, w, off, group_sizes=sizes, **kw)
    return kernels.grouped_mm_wgrad(x, dy, off, num_groups=w.shape[0], group_sizes=sizes, **kw)


def _reference(direction, x, w, dy, off, sizes):
    xf, wf, dyf = x.cpu().float(), w.cpu().float(), dy.cpu().float()
    off_c = off.cpu()
    if direction == "fwd":
        return loop_backend.forward(xf, wf, off_c)
    if direction == "dgrad":
        return loop_backend.dgrad(dyf, wf, off_c)
    return loop_backend.wgrad(xf, dyf, off_c, w.shape[0])


@pytest.mark.parametrize("ragged", [False, True], ids=["even", "ragged"])
@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
def test_tuned_call_matches_untuned(cuda_device, fresh_tuner, monkeypatch, direction, ragged):
    x, w, dy, off, sizes = _operands(direction, ragged, cuda_device)
    ref = _reference(direction, x, w, dy, off, sizes)
    with settings.override(tune=False):
        untuned = _call(direction, x, w, dy, off, sizes).float().cpu()
    assert not fresh_tuner.table_for(cuda_device.index).ms  # off: nothing measured
    first = _call(direction, x, w, dy, off, sizes).float().cpu()  # measures, then runs the choice
    again = _call(direction, x, w, dy, off, sizes).float().cpu()  # the entry's answer
    again2 = _call(direction, x, w, dy, off, sizes).float().cpu()
    row = x if direction != "dgrad" else dy
    assert kernels.describe_choice(direction, row, w, group_sizes=sizes).endswith(" measured")
    tol = dict(rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    torch.testing.assert_close(untuned, ref, **tol)
    torch.testing.assert_close(first, ref, **tol)
    torch.testing.assert_close(again, ref, **tol)
    torch.testing.assert_close(again2, again, rtol=0, atol=0)  # the same kernel: bit-identical


@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
def test_every_ranked_candidate_computes_the_same_values(cuda_device, fresh_tuner, direction):
    """A fast wrong kernel must never win: every choice the measurement timed gives the reference values."""
    x, w, dy, off, sizes = _operands(direction, True, cuda_device)
    ref = _reference(direction, x, w, dy, off, sizes)
    _call(direction, x, w, dy, off, sizes)
    (ms,) = fresh_tuner.table_for(cuda_device.index).ms.values()
    assert len(ms) >= 2 and ("torch", None) in ms  # torch is always timed
    tol = dict(rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    for choice in ms:
        if direction == "fwd":
            got = entry._function("fwd", choice)(x, w, off, None, None, torch.bfloat16, tuple(sizes))
        elif direction == "dgrad":
            got = entry._function("dgrad", choice)(dy, w, off, None, torch.bfloat16, tuple(sizes))
        else:
            got = entry._function("wgrad", choice)(x, dy, off, w.shape[0], torch.bfloat16, tuple(sizes))
        torch.testing.assert_close(got.float().cpu(), ref, **tol, msg=f"{choice} disagrees")
