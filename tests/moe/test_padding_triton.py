"""The padding maps' Triton kernels against the torch ops they replace.

Two places run them: the GPU (``-m gpu``), and the CPU under Triton's interpreter where Triton is
installed and ``TRITON_INTERPRET=1`` is set before it is imported (CI has no Triton: skipped there):
``TRITON_INTERPRET=1 python -m pytest -q tests/moe/test_padding_triton.py``.
"""

import importlib.util
import os

import pytest
import torch

from te_dist import settings
from te_dist.moe import padding

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
        reason="Triton interpreter run: needs triton and TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_experts", [1, 3, 64, 128, 257])
@pytest.mark.parametrize("alignment", [1, 16, 128])
@pytest.mark.parametrize("total", [None, 128], ids=["groups", "total128"])
def test_triton_padding_maps_equal_the_torch_ops(num_experts, alignment, total, device):
    from te_dist.moe.padding_triton import padding_maps as maps

    gen = torch.Generator().manual_seed(num_experts * alignment)
    counts = (torch.randint(0, 3, (num_experts,), generator=gen) * 67
              + torch.randint(0, 2, (num_experts,), generator=gen) * 128).to(device)
    rows = int(counts.sum())
    for bound in (rows, rows + 1000):  # exact, and queued for more rows than arrive
        want = padding._padding_maps_eager(counts, alignment, bound, total)
        got = maps(counts, alignment, bound, total)
        assert total is None or int(want[0][-1]) % total == 0
        num_padded = int(want[0][-1])
        # the entries a plan cut to these counts uses
        used = {0: num_experts, 1: rows, 2: num_padded, 3: num_padded - rows}
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape)
            assert torch.equal(g[:used[i]], w[:used[i]]), (i, g[:used[i]], w[:used[i]])
    if device == "cuda":  # the dispatcher's entry point takes the Triton path there
        assert padding._triton_maps() is not None, "Triton padding kernels did not load"
        with settings.override(pad_expert_total_rows=total is not None):
            plan = padding.queue_padding_plan(counts, alignment, rows).sized(tuple(counts.tolist()))
        want_offsets = padding._padding_maps_eager(counts.cpu(), alignment, rows, total)[0]
        assert plan.splits.offsets.tolist() == want_offsets.tolist()
        with settings.override(triton_padding=False):  # the switch: torch ops on CUDA too
            assert padding._triton_maps() is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("total_rows", [False, True], ids=["groups", "groups+total"])
@pytest.mark.parametrize("alignment", [16, 128])
def test_padded_dispatch_equals_unpadded(alignment, total_rows, device):
    """EP size 1 (on the GPU the Triton maps folded into the expand gather; on the CPU the torch ops): the
    padded rows are zero, and dispatch -> probability scale -> combine gives the unpadded result and
    gradients; with pad_expert_total_rows the last expert also rounds the total up to 128 rows."""
    from te_dist.moe.transports.all_to_all import AllToAllDispatcher

    torch.manual_seed(0)
    T, K, E, H = 300, 4, 32, 64
    x = torch.randn(T, H, device=device, requires_grad=True)
    probs, indices = torch.randn(T, E, device=device).softmax(-1).topk(K)
    probs.requires_grad_(True)
    grad = torch.randn_like(x)
    dispatcher = AllToAllDispatcher(E)
    results = []
    for row_alignment in (None, alignment):
        with settings.override(pad_expert_total_rows=total_rows):
            x_NH, sizes, probs_N, state = dispatcher.dispatch(x, probs, indices, probs_in_expert=True,
                                                              row_alignment=row_alignment)
        splits = state.group_splits()
        assert splits.offsets.tolist() == torch.tensor(splits.sizes).cumsum(0).tolist()
        if row_alignment is not None:
            last = len(sizes) - 1
            assert all(p % alignment == 0 and (p - s < alignment or e == last)
                       for e, (p, s) in enumerate(zip(splits.sizes, sizes.tolist())))
            assert sum(splits.sizes) % (128 if total_rows else alignment) == 0
            assert sum(splits.sizes) - sum(sizes.tolist()) < E * alignment + (128 if total_rows else 0)
            is_pad = torch.cat([torch.arange(p) >= s for s, p in zip(sizes.tolist(), splits.sizes)]).to(device)
            assert not x_NH[is_pad].any() and not probs_N[is_pad].any()
        y = dispatcher.combine(x_NH * probs_N[:, None], state)
        results.append((y, *torch.autograd.grad(y, (x, probs), grad)))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)
