"""The peer-rows transport: its row map (simulated over R ranks in one process) on CPU, its kernels
compiled by nvcc (wherever nvcc exists) and run with stand-in ranks on one GPU (its choice:
tests/moe/test_transports.py).

The map is what te_dist/moe/transports/peer/peer_rows.cu computes on the device; the GPU tests
(tests/moe/test_dispatcher_multiprocess.py, tests/moe/test_layer_multiprocess.py, marked gpu) run
the kernels themselves against the all-to-all path and the closed-form references.
"""

import shutil
import subprocess

import pytest
import torch

from cutlass_kernels import build
from te_dist.moe.transports.peer import availability, library
from te_dist.moe.transports.peer import rows as peer_rows
from te_dist.moe.transports.peer.rows import expected_sources


def _tags(matrix, r):
    """Rank r's rows in send order (sorted by global expert) as (source rank, expert, index within expert)."""
    expert = torch.repeat_interleave(torch.arange(matrix.shape[1]), matrix[r])
    within = torch.cat([torch.arange(int(c)) for c in matrix[r]]) if len(expert) else torch.zeros(0, dtype=torch.int64)
    return torch.stack([torch.full_like(expert, r), expert, within], 1)


def _simulate(matrix):
    """Every rank pulls its received rows through the map from the senders' rows; returns what each received."""
    R = matrix.shape[0]
    sent = [_tags(matrix, r) for r in range(R)]
    out = []
    for d in range(R):
        src_rank, src_row = expected_sources(matrix, d)
        out.append(torch.stack([sent[r][i] for r, i in zip(src_rank.tolist(), src_row.tolist())])
                   if len(src_rank) else torch.zeros(0, 3, dtype=torch.int64))
    return out


@pytest.mark.parametrize("R,El", [(1, 4), (2, 1), (2, 4), (4, 2), (4, 3)])
def test_rows_arrive_grouped_by_local_expert_then_source_rank_and_each_once(R, El):
    gen = torch.Generator().manual_seed(R * 10 + El)
    matrix = torch.randint(0, 5, (R, R * El), generator=gen)
    matrix[0, :El] = 0  # rank 0 sends nothing to its own experts
    if R > 1:
        matrix[:, El:2 * El] = 0  # rank 1 receives nothing
    received = _simulate(matrix)
    for d, rows in enumerate(received):
        expected = [(r, d * El + l, i) for l in range(El) for r in range(R) for i in range(int(matrix[r, d * El + l]))]
        assert rows.tolist() == [list(t) for t in expected]
    every = torch.cat(received).tolist()
    assert sorted(map(tuple, every)) == sorted(map(tuple, torch.cat([_tags(matrix, r) for r in range(R)]).tolist()))


def test_empty_sender_and_empty_matrix():
    matrix = torch.tensor([[0, 0, 0, 0], [2, 0, 1, 3]])
    got = _simulate(matrix)
    assert got[0].tolist() == [[1, 0, 0], [1, 0, 1]]
    assert got[1].tolist() == [[1, 2, 0], [1, 3, 0], [1, 3, 1], [1, 3, 2]]
    assert [b.shape[0] for b in _simulate(torch.zeros(2, 4, dtype=torch.int64))] == [0, 0]


@pytest.mark.skipif(shutil.which("nvcc") is None and build.find_nvcc() is None,
                    reason="nvcc is absent on this machine (the .cu build check needs the CUDA compiler)")
def test_nvcc_compiles_peer_rows(tmp_path, monkeypatch):
    """The expert-parallel row moves (plain CUDA, no CUTLASS): compiled, cached, exporting the C ABI."""
    monkeypatch.setenv("TE_DIST_CACHE", str(tmp_path))
    path = build.build_plain_source(library.SOURCE)
    assert path.parent == tmp_path and path.name.startswith("peer_rows-")
    symbols = subprocess.run(["nm", "-D", str(path)], capture_output=True, text=True, check=True).stdout
    for name in ("te_pr_barrier", "te_pr_plan", "te_pr_move", "te_pr_exchange", "te_pr_wait_counts", "te_pr_new_event",
                 "te_pr_device_address", "te_pr_last_error"):
        assert f" T {name}" in symbols, f"{name} is not exported by {path.name}"
    mtime = path.stat().st_mtime_ns
    assert build.build_plain_source(library.SOURCE) == path and path.stat().st_mtime_ns == mtime
    assert build._entry(library.SOURCE, "peer_rows")[0] == path  # the key: source, arch, flags, nvcc version
    assert build._entry(library.SOURCE, "peer_rows", None, build.BASE_FLAGS + ("-DEXTRA",))[0] != path


def test_local_support_names_the_reason_on_cpu():
    assert availability._local_support(torch.device("cpu")) == "tensors on cpu"


@pytest.mark.gpu
@pytest.mark.parametrize("R,El,H,tail", [(2, 4, 8, 0), (4, 3, 24, 4), (8, 1, 68, 4)])
def test_plan_pull_push_kernels_on_one_gpu(cuda_device, R, El, H, tail):
    """peer_rows.cu with R stand-in ranks on one GPU (their "peer" regions are local buffers): the
    plan kernel's map equals expected_sources, pulls bring every sent row once into (local expert,
    source rank) order, split into two column blocks where ``tail`` > 0, and pushes put them back."""
    from te_dist.moe.transports.peer.library import load_peer_rows

    lib = load_peer_rows()
    stream = torch.cuda.current_stream(cuda_device).cuda_stream
    E, W = R * El, H + tail
    matrix = torch.randint(0, 9, (R, E), generator=torch.Generator().manual_seed(R * El))
    matrix[:, :El] = 0  # rank 0 receives nothing
    matrix[R - 1] = 0  # the last rank sends nothing
    capacity = int(matrix.sum(1).max()) + 3
    regions = [torch.full((capacity, W), -1.0, device=cuda_device) for _ in range(R)]
    for r in range(R):  # each rank's rows in its region, send order: (rank, expert, index, then 3, 4, ...)
        tags = _tags(matrix, r).float()
        regions[r][:len(tags), :3] = tags.to(cuda_device)
        regions[r][:len(tags), 3:] = torch.arange(3, W, dtype=torch.float32, device=cuda_device)
    sent = [region.clone() for region in regions]
    table = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64, device=cuda_device)
    m_dev = matrix.to(cuda_device)
    for me in range(R):
        block_end = torch.empty(E, dtype=torch.int64, device=cuda_device)
        src_base = torch.empty_like(block_end)
        sizes = torch.empty(El, dtype=torch.int64, device=cuda_device)
        offsets = torch.empty(El, dtype=torch.int32, device=cuda_device)
        lib.plan(m_dev.data_ptr(), R, E, me, block_end.data_ptr(), src_base.data_ptr(), sizes.data_ptr(),
                 offsets.data_ptr(), stream)
        mine = matrix[:, me * El:(me + 1) * El].sum(0)
        assert sizes.cpu().tolist() == mine.tolist()
        assert offsets.cpu().tolist() == torch.cumsum(mine, 0).tolist()
        N = int(mine.sum())
        src_rank, src_row = expected_sources(matrix, me)
        if N:  # the kernel's map, read back on the host, against the reference
            block = torch.searchsorted(block_end.cpu(), torch.arange(N), right=True)
            assert torch.equal(block % R, src_rank) and torch.equal(torch.arange(N) + src_base.cpu()[block], src_row)
        a = torch.zeros(N, H, device=cuda_device)
        b = torch.zeros(N, tail, device=cuda_device)
        lib.move(False, a.data_ptr(), H * 4, b.data_ptr() if tail else 0, tail * 4, N, block_end.data_ptr(),
                 src_base.data_ptr(), E, R, table.data_ptr(), 64, stream)
        want = [(r, me * El + l, i) for l in range(El) for r in range(R) for i in range(int(matrix[r, me * El + l]))]
        assert a[:, :3].long().cpu().tolist() == [list(t) for t in want]
        assert torch.equal(torch.cat([a, b], 1)[:, 3:].cpu(), torch.arange(3, W).float().expand(N, -1))
        for region in (regions[r] for r in range(R)):  # push: clear the rows' sources, then write them back
            region[:, :3] = -1.0
        lib.move(True, a.data_ptr(), H * 4, b.data_ptr() if tail else 0, tail * 4, N, block_end.data_ptr(),
                 src_base.data_ptr(), E, R, table.data_ptr(), 64, stream)
        torch.cuda.synchronize()
        for r in range(R):
            rows = src_row[src_rank == r]
            assert torch.equal(regions[r][rows], sent[r][rows])  # exactly the rows this rank received
            others = torch.ones(capacity, dtype=torch.bool)
            others[rows] = False
            assert torch.all(regions[r][others.to(cuda_device), :3] == -1.0)  # and nothing else
            regions[r].copy_(sent[r])


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
                                           r"opened\); build the MoE layer with transport='all_to_all'"):
        ws.ensure(8, 1 << 20, keep_bytes=4096)
    assert ws.buffer is None and (ws.num_experts, ws.rows_bytes) == (0, 0)  # nothing half-updated


@pytest.mark.parametrize("counts,row_bytes,match", [
    (torch.zeros(7, dtype=torch.int64), 64, "7 experts are not divisible by the EP size 2"),
    (torch.zeros(8, dtype=torch.int32), 64, "expected int64 counts and rows of a multiple of 16 bytes, got torch.int32"),
    (torch.zeros(8, dtype=torch.int64), 24, "rows of a multiple of 16 bytes, got torch.int64 and 24 bytes"),
])
def test_bad_exchange_arguments_raise_before_anything_is_launched(counts, row_bytes, match):
    """Checked on the host first: the workspace (no buffer yet, no device) is never touched."""
    ws = object.__new__(peer_rows.PeerWorkspace)
    ws.buffer, ws.num_experts, ws.rows_bytes, ws.world, ws.rank = None, 0, 0, 2, 0
    with pytest.raises(ValueError, match=match):
        peer_rows.begin_exchange(ws, counts, row_bytes)
    assert ws.buffer is None and ws.num_experts == 0


@pytest.mark.gpu
def test_exchange_kernel_writes_matrix_header_and_flag_on_one_gpu(cuda_device):
    """te_pr_exchange with one rank (its barriers have no peer): the count matrix, the header (rows
    sent, received, most sent, smallest count) and the flag land in pinned host memory, the host's
    wait returns on the flag (in slices: one ends "not ready" while the GPU is busy), a wait for a
    flag that never comes raises once the kernel is done, and memory that is not pinned is refused."""
    from te_dist.moe.transports.peer.library import load_peer_rows

    lib = load_peer_rows()
    stream = torch.cuda.current_stream(cuda_device).cuda_stream
    E = 6
    pads = torch.zeros(8, dtype=torch.int32, device=cuda_device)
    pad_table = torch.tensor([pads.data_ptr()], dtype=torch.int64, device=cuda_device)
    region = torch.full((E,), -5, dtype=torch.int64, device=cuda_device)
    region_table = torch.tensor([region.data_ptr()], dtype=torch.int64, device=cuda_device)
    host = torch.zeros(E + 4, dtype=torch.int64, pin_memory=True)
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    event = lib.new_event()
    for seq, sent in ((7, [3, 0, 7, 1, 2, 4]), (8, [3, -1, 7, 1, 2, 4]), (9, [0, 0, 5, 0, 0, 1])):
        counts = torch.tensor(sent, dtype=torch.int64, device=cuda_device)
        scratch = torch.empty(2 * E + E + (E + 1) // 2, dtype=torch.int64, device=cuda_device)
        t = scratch.data_ptr()
        if seq == 9:  # the GPU is busy for ~0.1 s first: a 1 ms slice of the wait ends with "not ready"
            torch.cuda._sleep(200_000_000)
        lib.exchange(pad_table.data_ptr(), 0, 1, 10**9, counts.data_ptr(), E, region_table.data_ptr(), region.data_ptr(),
                     t, t + 8 * E, t + 16 * E, t + 24 * E, lib.device_address(host.data_ptr()),
                     lib.device_address(flag.data_ptr()), seq, event, stream)
        if seq == 9:
            assert lib._lib.te_pr_wait_counts(flag.data_ptr(), seq, event, 10**6) == 600  # cudaErrorNotReady
        lib.wait_counts(flag.data_ptr(), seq, event)
        assert host[:E].tolist() == sent and region.cpu().tolist() == sent
        assert host[E:].tolist() == [sum(sent), sum(sent), sum(sent), min(sent)]
    with pytest.raises(RuntimeError, match="flag 9 != 10"):
        lib.wait_counts(flag.data_ptr(), 10, event)
    with pytest.raises(RuntimeError, match="not pinned"):
        lib.device_address(torch.zeros(4).data_ptr())
