"""Measured choices on a GPU: a tuned call computes what the untuned one does, on every candidate.

Different kernels sum in different orders, so values agree to bf16 rounding, checked against the
float32 loop reference with the same tolerance for both.
"""

from __future__ import annotations

import pytest
import torch

from te_dist import kernels
from te_dist.backends import autotune, loop_backend
from te_dist.backends.bucket_timing import estimate

pytestmark = pytest.mark.gpu


@pytest.fixture
def fresh_tuner(tmp_path, monkeypatch):
    monkeypatch.delenv(autotune.ENV, raising=False)
    tuner = autotune.reset()
    autotune.configure(directory=tmp_path, bucket_ms=200, total_ms=float("inf"))
    yield tuner
    autotune.reset()


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
    fresh_tuner.settings.enabled = False
    untuned = _call(direction, x, w, dy, off, sizes).float().cpu()
    assert not fresh_tuner.table_for(cuda_device.index).ranking  # off: nothing measured
    fresh_tuner.settings.enabled = True
    first = _call(direction, x, w, dy, off, sizes).float().cpu()  # measures, then runs the winner
    table = fresh_tuner.table_for(cuda_device.index)
    for _ in range(200):  # a bucket the first call left undecided settles on the next calls
        if not table.settling:
            break
        _call(direction, x, w, dy, off, sizes).float().cpu()
    again = _call(direction, x, w, dy, off, sizes).float().cpu()  # the table's answer
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
    """A fast wrong kernel must never win: every choice the tuner timed gives the reference values."""
    x, w, dy, off, sizes = _operands(direction, True, cuda_device)
    ref = _reference(direction, x, w, dy, off, sizes)
    _call(direction, x, w, dy, off, sizes)
    table = fresh_tuner.table_for(cuda_device.index)
    (ranking,) = table.ranking.values()
    assert len(ranking) >= 2 and any(c[0] == "torch" for c in ranking)  # torch is always timed
    tol = dict(rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    for choice in ranking:
        if direction == "fwd":
            got = kernels._forward_with(choice, x, w, off, None, None, torch.bfloat16, tuple(sizes))
        elif direction == "dgrad":
            got = kernels._dgrad_with(choice, dy, w, off, None, torch.bfloat16, tuple(sizes))
        else:
            got = kernels._wgrad_with(choice, x, dy, off, w.shape[0], torch.bfloat16, tuple(sizes))
        torch.testing.assert_close(got.float().cpu(), ref, **tol, msg=f"{choice} disagrees")


@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
def test_live_settling_calls_compute_the_reference_and_settle(cuda_device, fresh_tuner, monkeypatch, direction):
    """A bucket its first call left undecided (forced here: every candidate) is timed on its next
    calls between CUDA events read without waiting; every one of those calls returns the reference
    values, and the bucket settles on a ranking of what it timed."""
    monkeypatch.setattr(autotune, "undecided", lambda timings, cands: [min(timings, key=timings.get)]
                        + [c for c in cands if c != min(timings, key=timings.get)])
    x, w, dy, off, sizes = _operands(direction, True, cuda_device)
    ref = _reference(direction, x, w, dy, off, sizes)
    tol = dict(rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    row = x if direction != "dgrad" else dy
    _call(direction, x, w, dy, off, sizes)
    table = fresh_tuner.table_for(cuda_device.index)
    (settling,) = table.settling.values()
    assert kernels.describe_choice(direction, row, w, group_sizes=sizes).endswith(" settling")
    for _ in range(200):
        if not table.settling:
            break
        torch.testing.assert_close(_call(direction, x, w, dy, off, sizes).float().cpu(), ref, **tol)
    assert not table.settling and settling.finished
    live = {c: estimate(s) for c, s in settling.samples.items() if s}
    assert len(live) >= 2
    (ranking,) = table.ranking.values()
    assert ranking[0] == min(live, key=live.get)
    assert kernels.describe_choice(direction, row, w, group_sizes=sizes).endswith(" measured")
    torch.testing.assert_close(_call(direction, x, w, dy, off, sizes).float().cpu(), ref, **tol)
