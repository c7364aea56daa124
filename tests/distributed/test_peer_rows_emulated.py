"""The peer-rows dispatch and combine on CPU: R threads stand in for R ranks, and peer_rows.cu's C
ABI is emulated on host memory (ctypes moves through the same raw addresses the kernels get).

Why: CI has no GPU, and peer rows are the default transport on the GPUs of one host. This runs the
real te_dist.moe.transports.peer.autograd / te_dist.moe.transports.peer.rows code (region sizing, growth that keeps
rows packed into a region, rows staged outside it, the in-band error flag, every move forward and
backward) against the closed-form reference of the stand-in experts. The kernels themselves are
tested on a GPU (test_peer_rows.py, and the NCCL tests in tests/moe).
"""

import contextlib
import ctypes
import threading
from bisect import bisect_right
from types import SimpleNamespace

import pytest
import torch

import torch.distributed._symmetric_memory as symm_mem
from te_dist.moe.transports.peer import rows as peer_rows
from te_dist.moe.transports.peer.autograd import peer_combine, peer_dispatch
from te_dist.moe.permutation import permute_probs, sort_by_expert, unpermute_tokens


def _i64(address, n):
    return (ctypes.c_int64 * n).from_address(address)


class _World:
    """What the R stand-in ranks share: a thread barrier and the rendezvous of their buffers."""

    def __init__(self, R):
        self.R = R
        self.gate = threading.Barrier(R, timeout=60)  # a lost rank breaks it: an error, not a hang
        self.buffers = [None] * R
        self.local = threading.local()
        self.moves = 0


class _EmulatedLib:
    """peer_rows.cu's launches, run on host memory by the calling thread (its rank)."""

    def __init__(self, world):
        self.world = world

    def barrier(self, pads, channel, rank, world, timeout_ns, stream):
        self.world.gate.wait()

    def exchange(self, pads, me, R, timeout_ns, counts, E, peer_counts, matrix, block_end, src_base, local_sizes,
                 local_offsets, host, host_flag, seq, event, stream):
        self.world.gate.wait()
        mine = list(_i64(counts, E))
        for base in _i64(peer_counts, R):
            _i64(base + me * E * 8, E)[:] = mine
        self.world.gate.wait()
        M = list(_i64(matrix, R * E))
        El, first = E // R, me * E // R
        ends, bases, sizes, end = [], [], [], 0
        for l in range(El):  # blocks (local expert l, source rank r), as the plan kernel orders them
            for r in range(R):
                send_start = sum(M[r * E:r * E + first + l])
                bases.append(send_start - end)
                end += M[r * E + first + l]
                ends.append(end)
            sizes.append(end - sum(sizes))
        _i64(block_end, E)[:], _i64(src_base, E)[:], _i64(local_sizes, El)[:] = ends, bases, sizes
        (ctypes.c_int32 * El).from_address(local_offsets)[:] = [sum(sizes[:l + 1]) for l in range(El)]
        ctypes.memmove(host, matrix, 8 * R * E)
        sent = [sum(M[r * E:(r + 1) * E]) for r in range(R)]
        _i64(host + 8 * R * E, 4)[:] = [sent[me], end, max(sent), min(M)]  # the header: see exchange_kernel
        _i64(host_flag, 1)[0] = seq

    def wait_counts(self, host_flag, seq, event):
        assert _i64(host_flag, 1)[0] == seq, "the host waits for an exchange that was not the last one queued"

    def new_event(self):
        return 0

    def device_address(self, host):
        return host  # host memory: the emulated kernels use host addresses

    def move(self, push, a, a_bytes, b, b_bytes, N, block_end, src_base, blocks, world, peer_rows_table, max_blocks,
             stream):
        ends, bases, peers = list(_i64(block_end, blocks)), list(_i64(src_base, blocks)), list(_i64(peer_rows_table, world))
        for n in range(N):
            blk = bisect_right(ends, n)
            remote = peers[blk % world] + (n + bases[blk]) * (a_bytes + b_bytes)
            for local, width, at in ((a + n * a_bytes, a_bytes, remote), (b + n * b_bytes, b_bytes, remote + a_bytes)):
                if width:
                    ctypes.memmove(at, local, width) if push else ctypes.memmove(local, at, width)
        self.world.moves += 1


@pytest.fixture
def emulated(monkeypatch):
    """A factory of R emulated ranks: returns (world, [workspace per rank])."""

    def make(R):
        world = _World(R)

        def rendezvous(buffer, group):
            rank = world.local.rank
            world.buffers[rank] = buffer
            world.gate.wait()
            handle = SimpleNamespace(rank=rank, buffer_ptrs=[t.data_ptr() for t in world.buffers], signal_pad_ptrs_dev=0)
            world.gate.wait()
            return handle

        monkeypatch.setattr(symm_mem, "empty", lambda n, dtype, device: torch.zeros(n, dtype=dtype))
        monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0, synchronize=lambda: None))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # a CPU device's index
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        lib = _EmulatedLib(world)
        workspaces = []
        for r in range(R):
            ws = object.__new__(peer_rows.PeerWorkspace)
            ws.group, ws.world, ws.rank, ws.device, ws.lib, ws.max_blocks = None, R, r, torch.device("cpu"), lib, 1
            ws.num_experts, ws.rows_bytes, ws.buffer, ws.handle, ws.host_counts = 0, 0, None, None, None
            ws.exchanges, ws.host_flag, ws.exchange_done = 0, torch.zeros(1, dtype=torch.int64), 0
            ws.host_flag_ptr = ws.host_flag_device = ws.host_flag.data_ptr()
            workspaces.append(ws)
        return world, workspaces

    return make


def _on_every_rank(world, fn):
    """Run fn(rank) on R threads; re-raise the first failure (a failed rank breaks the others' barrier)."""
    results, errors = [None] * world.R, []

    def body(rank):
        world.local.rank = rank
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append((rank, exc))
            world.gate.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world.R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [(r, e) for r, e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        rank, exc = (real or errors)[0]
        raise AssertionError(f"rank {rank} failed: {type(exc).__name__}: {exc}") from exc
    return results


def _batch(rank, T, E, K, H, skewed=False):
    gen = torch.Generator().manual_seed(100 + rank + T)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64).requires_grad_(True)
    probs = torch.rand(T, K, generator=gen, dtype=torch.float64).requires_grad_(True)
    pool = K if skewed else E
    indices = torch.stack([torch.randperm(pool, generator=gen)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    return x, probs, indices


def _step(ws, rank, T, E, K, H, probs_in_expert=True, skewed=False, invalid=False):
    """One dispatch, stand-in experts (global expert g scales its rows by g + 1), combine and backward
    on this rank, checked against the closed form; returns (rows received, rows sent)."""
    x, probs, indices = _batch(rank, T, E, K, H, skewed)
    perm = sort_by_expert(x, indices, E)
    counts = torch.full_like(perm.counts_E, -1) if invalid else perm.counts_E
    probs_S = permute_probs(probs, perm) if probs_in_expert else None
    x_N, probs_N, plan = peer_dispatch(ws, x, probs_S, perm, counts)
    if plan.invalid:
        return "invalid"
    assert plan.matrix_row(ws.rank) == counts.tolist()  # the host's matrix, read after any growth
    El = E // ws.world
    scale = torch.repeat_interleave(torch.arange(El, dtype=x.dtype) + ws.rank * El + 1, plan.local_sizes)
    y_N = x_N * scale[:, None]
    if probs_in_expert:
        out = peer_combine(y_N * probs_N[:, None], plan, perm)
    else:
        out = unpermute_tokens(peer_combine(y_N, plan, perm, sum_rows=False), perm, probs)
    ref_x, ref_p = x.detach().clone().requires_grad_(True), probs.detach().clone().requires_grad_(True)
    ref = (ref_p * (indices + 1).to(x.dtype)).sum(-1, keepdim=True) * ref_x
    torch.testing.assert_close(out, ref)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    torch.testing.assert_close(torch.autograd.grad(out, (x, probs), g), torch.autograd.grad(ref, (ref_x, ref_p), g))
    return plan.num_received, plan.num_sent


@pytest.mark.parametrize("R,E", [(2, 8), (4, 8), (3, 3)])
def test_dispatch_combine_forward_backward_on_emulated_ranks(emulated, R, E):
    """Ragged batches (rank r holds 5 + r tokens), probabilities in the expert and at combine, and
    skewed routing where every rank but rank 0 receives nothing."""
    world, ws = emulated(R)
    K, H = 2, 6  # rows of 48 bytes, the payload's 64
    for probs_in_expert in (True, False):
        got = _on_every_rank(world, lambda r: _step(ws[r], r, 5 + r, E, K, H, probs_in_expert))
        assert sum(n for n, _ in got) == sum(s for _, s in got) == sum((5 + r) * K for r in range(R))
    if E // R >= K:  # rank 0 owns the first K experts
        got = _on_every_rank(world, lambda r: _step(ws[r], r, 5 + r, E, K, H, skewed=True))
        assert [n for n, _ in got][1:] == [0] * (R - 1) and got[0][0] == sum((5 + r) * K for r in range(R))


def test_regions_grow_under_packed_rows_and_take_staged_ones(emulated):
    """The first dispatch stages every rank's rows (no region yet). Later rank 1 sends more rows than
    the 2 MiB region holds: every region grows, rank 0's rows packed into its old region survive and
    rank 1's, packed outside, are copied in. A rank with no tokens takes part in every move."""
    world, ws = emulated(2)
    E, K, H = 4, 2, 64  # payload rows of 528 bytes: 2 MiB hold 3971
    _on_every_rank(world, lambda r: _step(ws[r], r, 3, E, K, H))
    first = [w.rows_bytes for w in ws]
    assert first == [2 << 20, 2 << 20]
    got = _on_every_rank(world, lambda r: _step(ws[r], r, 2500 if r == 1 else 4, E, K, H))
    assert [s for _, s in got] == [8, 5000]
    assert all(w.rows_bytes > first[0] for w in ws) and ws[0].rows_bytes == ws[1].rows_bytes
    got = _on_every_rank(world, lambda r: _step(ws[r], r, 0 if r == 0 else 6, E, K, H))
    assert got[0][1] == 0 and sum(n for n, _ in got) == 12


def test_invalid_routing_on_one_rank_moves_nothing_on_every_rank(emulated):
    """-1 counts from rank 1: every rank sees plan.invalid after the exchange and no rows move."""
    world, ws = emulated(2)
    _on_every_rank(world, lambda r: _step(ws[r], r, 4, 4, 2, 8))  # sizes the regions
    before = world.moves
    got = _on_every_rank(world, lambda r: _step(ws[r], r, 4, 4, 2, 8, invalid=r == 1))
    assert got == ["invalid", "invalid"] and world.moves == before


def test_peer_dispatcher_on_emulated_ranks(emulated, monkeypatch):
    """The transport class end to end (its state, the agreed splits, combine with probabilities in
    the expert and at combine, and the RoutingError every rank raises on one rank's NaN flag)."""
    from te_dist.moe.transports import RoutingError, base
    from te_dist.moe.transports.peer import dispatcher as peer_module

    R, E, K, H = 2, 8, 2, 6
    world, ws = emulated(R)
    monkeypatch.setattr(base, "group_size", lambda group: R)
    monkeypatch.setattr(base, "group_rank", lambda group: world.local.rank)
    monkeypatch.setattr(peer_module, "peer_workspace", lambda group, device: ws[world.local.rank])
    monkeypatch.setattr(peer_module, "use_peer_rows", lambda *args, **kwargs: True)  # the agreement: yes

    def step(rank, probs_in_expert, invalid=False):
        d = peer_module.PeerDispatcher(E, None)
        x, probs, indices = _batch(rank, 5 + rank, E, K, H)
        flag = torch.tensor(invalid)
        try:
            x_N, splits, probs_N, state = d.dispatch(x, probs, indices, probs_in_expert=probs_in_expert, invalid=flag)
        except RoutingError as exc:
            return str(exc)
        assert state.transport == "peer" and state.group_splits().sizes == tuple(splits.tolist())
        scale = torch.repeat_interleave(torch.arange(d.num_local_experts, dtype=x.dtype) + d.first_expert + 1, splits)
        y_N = x_N * scale[:, None]
        out = d.combine(y_N * probs_N[:, None] if probs_in_expert else y_N, state)
        torch.testing.assert_close(out, (probs * (indices + 1).to(x.dtype)).sum(-1, keepdim=True) * x)
        return sum(state.output_splits)

    for probs_in_expert in (True, False):
        got = _on_every_rank(world, lambda r: step(r, probs_in_expert))
        assert sum(got) == sum((5 + r) * K for r in range(R))
    got = _on_every_rank(world, lambda r: step(r, True, invalid=r == 1))
    assert all("NaN or inf on EP rank(s) [1]" in g for g in got), got
