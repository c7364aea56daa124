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
    monkeypatch.setattr(peer_rows, "group_size", lambda group: 2)
    monkeypatch.setattr(peer_rows.dist, "get_backend", lambda group: "gloo")
    monkeypatch.setenv(peer_rows.TRANSPORT_ENV, "fast")
    with pytest.raises(ValueError, match="TE_DIST_EP_TRANSPORT must be 'auto', 'peer' or 'nccl', got 'fast'"):
        peer_rows.use_peer_rows(None, dev, 8, 64)
    for wanted in ("nccl", "auto"):
        monkeypatch.setenv(peer_rows.TRANSPORT_ENV, wanted)
        assert peer_rows.use_peer_rows(None, dev, 8, 64) is False  # gloo: the all-to-all
    monkeypatch.setenv(peer_rows.TRANSPORT_ENV, "peer")
    with pytest.raises(ValueError, match="=peer but peer rows cannot run: the EP group runs gloo, not nccl; "
                                         r"rows of 24 bytes \(a multiple of 16 is needed\); 4096 experts"):
        peer_rows.use_peer_rows(None, dev, 4096, 24)
    monkeypatch.setattr(peer_rows.dist, "get_backend", lambda group: "nccl")
    monkeypatch.setenv(peer_rows.TRANSPORT_ENV, "auto")
    # rows that are not a multiple of 16 bytes, or more experts than the plan kernel holds
    assert peer_rows.use_peer_rows(None, dev, 8, 24) is False
    assert peer_rows.use_peer_rows(None, dev, 4096, 64) is False


def test_local_support_names_the_reason_on_cpu():
    assert peer_rows._local_support(torch.device("cpu")) == "tensors on cpu"


def _tagged_rows(matrix, rank, H, device):
    """Rank ``rank``'s rows in send order, fp32 [S, H]: column 0 = rank, 1 = expert, 2 = index within expert."""
    expert = torch.repeat_interleave(torch.arange(matrix.shape[1]), matrix[rank])
    within = torch.cat([torch.arange(int(c)) for c in matrix[rank]]) if len(expert) else torch.zeros(0, dtype=torch.int64)
    rows = torch.zeros(len(expert), H)
    rows[:, 0], rows[:, 1], rows[:, 2] = float(rank), expert.float(), within.float()
    rows[:, 3:] = torch.arange(3, H).float()  # the rest of the row must travel too
    return rows.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("R,El,H", [(2, 4, 8), (4, 3, 24), (8, 1, 68)])
def test_plan_push_pull_kernels_on_one_gpu(cuda_device, R, El, H):
    """peer_rows.cu with R stand-in ranks on one GPU (their "peer" regions are local buffers): the
    plan kernel's map equals expected_layout, pushes land every row once in (local expert, source
    rank) order, pulls bring them back, and overflow / negative counts move nothing."""
    from cutlass_kernels.peer_rows import load_peer_rows

    lib = load_peer_rows()
    stream = torch.cuda.current_stream(cuda_device).cuda_stream
    E = R * El
    matrix = torch.randint(0, 9, (R, E), generator=torch.Generator().manual_seed(R * El))
    matrix[:, :El] = 0  # rank 0 receives nothing
    matrix[R - 1] = 0  # the last rank sends nothing
    received = [int(matrix[:, d * El:(d + 1) * El].sum()) for d in range(R)]
    capacity = max(received) + 3
    regions = [torch.full((capacity, H), -1.0, device=cuda_device) for _ in range(R)]
    table = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64, device=cuda_device)
    m_dev = matrix.to(cuda_device)
    row_bytes = H * 4
    plans = []
    for me in range(R):
        dst_base = torch.empty(E, dtype=torch.int64, device=cuda_device)
        send_end = torch.empty_like(dst_base)
        sizes = torch.empty(El, dtype=torch.int64, device=cuda_device)
        offsets = torch.empty(El, dtype=torch.int32, device=cuda_device)
        status = torch.full((1,), -1, dtype=torch.int32, device=cuda_device)
        lib.plan(m_dev.data_ptr(), R, E, me, capacity, dst_base.data_ptr(), send_end.data_ptr(), sizes.data_ptr(),
                 offsets.data_ptr(), status.data_ptr(), stream)
        rows = _tagged_rows(matrix, me, H, cuda_device)
        lib.move(True, rows.data_ptr(), rows.shape[0], row_bytes, dst_base.data_ptr(), send_end.data_ptr(), E, El,
                 table.data_ptr(), status.data_ptr(), 64, stream)
        plans.append((dst_base, send_end, rows))
        assert status.item() == 0
        mine = matrix[:, me * El:(me + 1) * El].sum(0)
        assert sizes.cpu().tolist() == mine.tolist()
        assert offsets.cpu().tolist() == torch.cumsum(mine, 0).tolist()
        dst_rank, dst_row = expected_layout(matrix, me)
        expert = torch.repeat_interleave(torch.arange(E), matrix[me])
        got_row = torch.arange(len(expert)) + dst_base.cpu()[expert]
        assert torch.equal(got_row, dst_row) and torch.equal(expert // El, dst_rank)
    torch.cuda.synchronize()
    for d in range(R):
        want = [(r, d * El + l, i) for l in range(El) for r in range(R) for i in range(int(matrix[r, d * El + l]))]
        got = regions[d][:received[d], :3].long().cpu().tolist()
        assert got == [list(t) for t in want]
        assert torch.equal(regions[d][:received[d], 3:].cpu(), torch.arange(3, H).float().expand(received[d], -1))
        assert torch.all(regions[d][received[d]:] == -1)  # nothing written past what this rank receives
    for me, (dst_base, send_end, rows) in enumerate(plans):  # pull: the same map read backwards
        back = torch.zeros_like(rows)
        lib.move(False, back.data_ptr(), rows.shape[0], row_bytes, dst_base.data_ptr(), send_end.data_ptr(), E, El,
                 table.data_ptr(), 0, 64, stream)
        assert torch.equal(back, rows)
    # Overflow (a region one row too small) and a negative count: status set, nothing moved.
    for bad, capacity_rows, flag in ((matrix, max(received) - 1, 2), (torch.where(matrix == matrix.max(), -1, matrix), capacity, 1)):
        status = torch.zeros(1, dtype=torch.int32, device=cuda_device)
        scratch = torch.empty(2 * E + El, dtype=torch.int64, device=cuda_device)
        offsets = torch.empty(El, dtype=torch.int32, device=cuda_device)
        lib.plan(bad.to(cuda_device).data_ptr(), R, E, 1, capacity_rows, scratch.data_ptr(), scratch[E:].data_ptr(),
                 scratch[2 * E:].data_ptr(), offsets.data_ptr(), status.data_ptr(), stream)
        assert status.item() & flag
        before = [r.clone() for r in regions]
        rows = plans[1][2]
        lib.move(True, rows.data_ptr(), rows.shape[0], row_bytes, scratch.data_ptr(), scratch[E:].data_ptr(), E, El,
                 table.data_ptr(), status.data_ptr(), 64, stream)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(before, regions))


def test_symmetric_memory_failure_names_the_way_out(monkeypatch):
    """Where peer mappings cannot be made (no IPC rights, say), the error says how to fall back."""
    import torch.distributed._symmetric_memory as symm_mem

    ws = object.__new__(peer_rows.PeerWorkspace)
    ws.buffer, ws.num_experts, ws.rows_bytes, ws.world, ws.rank = None, 0, 0, 2, 1
    ws.device, ws.group = torch.device("cpu"), None

    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA IPC handle could not be opened")

    monkeypatch.setattr(symm_mem, "empty", refuse)
    with pytest.raises(RuntimeError, match=r"failed on EP rank 1 \(RuntimeError: CUDA IPC handle could not be "
                                           r"opened\); set TE_DIST_EP_TRANSPORT=nccl on every rank"):
        ws.ensure(8, 1 << 20)
    assert ws.buffer is None and (ws.num_experts, ws.rows_bytes) == (0, 0)  # nothing half-updated


def test_agreed_choice_is_cached_and_forcing_peer_names_every_reason(monkeypatch):
    """The first call gathers every rank's host and support once; later calls reuse the answer, and
    TE_DIST_EP_TRANSPORT=peer raises with the gathered reasons even after an 'auto' call cached them."""
    class Group:
        group_name = "test-ep-group"

    calls = []

    def gather(out, mine, group=None):
        calls.append(mine)
        out[0], out[1] = mine, ("host-b", "")  # rank 1 on another host, able to run

    monkeypatch.setattr(peer_rows, "group_size", lambda group: 2)
    monkeypatch.setattr(peer_rows.dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(peer_rows.dist, "all_gather_object", gather)
    monkeypatch.setattr(peer_rows, "_choices", {})
    monkeypatch.setenv(peer_rows.TRANSPORT_ENV, "auto")
    dev = torch.device("cpu")
    assert peer_rows.use_peer_rows(Group(), dev, 8, 64) is False
    assert peer_rows.use_peer_rows(Group(), dev, 8, 64) is False
    assert len(calls) == 1  # agreed once per (group, device)
    monkeypatch.setenv(peer_rows.TRANSPORT_ENV, "peer")
    with pytest.raises(RuntimeError, match="=peer but peer rows are unavailable: rank 0: tensors on cpu; ranks on 2 hosts"):
        peer_rows.use_peer_rows(Group(), dev, 8, 64)
