"""The peer-rows transport on CPU: its row map (simulated over R ranks in one process) and its choice.

The map is what cutlass_kernels/peer_rows.cu computes on the device; the GPU tests
(tests/moe/test_dispatcher_multiprocess.py, tests/moe/test_layer_multiprocess.py, marked gpu) run
the kernels themselves against the all-to-all path and the closed-form references.
"""

import pytest
import torch

from te_dist.distributed import peer_rows
from te_dist.distributed.peer_rows import expected_layout


def _simulate(matrix):
    """Each rank pushes its tagged rows through the map; returns every rank's receive buffer."""
    R, E = matrix.shape
    El = E // R
    received = [matrix[:, d * El:(d + 1) * El].sum().item() for d in range(R)]
    buffers = [torch.full((n, 3), -1, dtype=torch.int64) for n in received]
    for r in range(R):
        expert = torch.repeat_interleave(torch.arange(E), matrix[r])
        within = torch.cat([torch.arange(int(c)) for c in matrix[r]]) if len(expert) else torch.zeros(0, dtype=torch.int64)
        tags = torch.stack([torch.full_like(expert, r), expert, within], 1)  # (source rank, expert, index)
        dst_rank, dst_row = expected_layout(matrix, r)
        for d in range(R):
            sel = dst_rank == d
            assert torch.all(buffers[d][dst_row[sel], 0] == -1), "two rows mapped to one destination row"
            buffers[d][dst_row[sel]] = tags[sel]
    return buffers


@pytest.mark.parametrize("R,El", [(1, 4), (2, 1), (2, 4), (4, 2), (4, 3)])
def test_rows_land_grouped_by_local_expert_then_source_rank(R, El):
    gen = torch.Generator().manual_seed(R * 10 + El)
    matrix = torch.randint(0, 5, (R, R * El), generator=gen)
    matrix[0, :El] = 0  # rank 0 sends nothing to its own experts
    if R > 1:
        matrix[:, El:2 * El] = 0  # rank 1 receives nothing
    for d, buf in enumerate(_simulate(matrix)):
        expected = [(r, d * El + l, i) for l in range(El) for r in range(R) for i in range(int(matrix[r, d * El + l]))]
        assert buf.tolist() == [list(t) for t in expected]


def test_empty_sender_and_empty_matrix():
    matrix = torch.tensor([[0, 0, 0, 0], [2, 0, 1, 3]])
    bufs = _simulate(matrix)
    assert bufs[0].tolist() == [[1, 0, 0], [1, 0, 1]]
    assert bufs[1].tolist() == [[1, 2, 0], [1, 3, 0], [1, 3, 1], [1, 3, 2]]
    assert [b.shape[0] for b in _simulate(torch.zeros(2, 4, dtype=torch.int64))] == [0, 0]


def test_choice_is_all_to_all_without_nccl_or_for_one_rank(monkeypatch):
    dev = torch.device("cpu")
    assert peer_rows.use_peer_rows(None, dev, 8, 64) is False  # one rank (no process group)
    monkeypatch.setenv(peer_rows.TRANSPORT_ENV, "fast")
    monkeypatch.setattr(peer_rows, "group_size", lambda group: 2)
    with pytest.raises(ValueError, match="TE_DIST_EP_TRANSPORT must be 'auto', 'peer' or 'nccl', got 'fast'"):
        peer_rows.use_peer_rows(None, dev, 8, 64)
    monkeypatch.setenv(peer_rows.TRANSPORT_ENV, "nccl")
    assert peer_rows.use_peer_rows(None, dev, 8, 64) is False
    # rows that are not a multiple of 16 bytes, or more experts than the plan kernel holds
    assert peer_rows.use_peer_rows(None, dev, 8, 24) is False
    assert peer_rows.use_peer_rows(None, dev, 4096, 64) is False


def test_local_support_names_the_reason_on_cpu():
    assert peer_rows._local_support(torch.device("cpu")) == "tensors on cpu"
