"""Synthetic Markov data: a pure function of (seed, step), sharded the same way at any rank count."""

import math

import torch

from te_dist.train.data import MarkovData


def _data(**kw):
    args = dict(vocab_size=16, seq_len=12, global_batch_size=4, branching=2, seed=7) | kw
    return MarkovData(args.pop("vocab_size"), args.pop("seq_len"), args.pop("global_batch_size"), **args)


def test_batches_depend_only_on_seed_and_step():
    a, b = _data(), _data()
    assert torch.equal(a.global_batch(5), b.global_batch(5))
    assert not torch.equal(a.global_batch(5), a.global_batch(6))
    assert not torch.equal(a.global_batch(5), _data(seed=8).global_batch(5))


def test_rank_shards_tile_the_global_batch():
    d = _data()
    full = d.global_batch(3)
    for world in (1, 2, 4):
        shards = [d.local_batch(3, r, world) for r in range(world)]
        inputs = torch.cat([x for x, _ in shards])
        targets = torch.cat([y for _, y in shards])
        assert torch.equal(inputs, full[:, :-1]) and torch.equal(targets, full[:, 1:])


def test_tokens_follow_the_chain():
    d = _data()
    tokens = d.global_batch(1)
    allowed = {(int(a), int(b)) for a in range(16) for b in d.successors_VC[a]}
    pairs = zip(tokens[:, :-1].flatten().tolist(), tokens[:, 1:].flatten().tolist())
    assert all(p in allowed for p in pairs)


def test_entropy_rate_is_learnable_and_below_uniform():
    d = _data(vocab_size=64, branching=2)
    h = d.entropy_rate()
    assert 0 < h <= math.log(2) + 1e-12 < d.uniform_loss()


def test_empirical_transitions_match_the_chain():
    """The sampled successor frequencies converge to the chain's probabilities (so the entropy
    rate printed as "best possible loss" is the real floor)."""
    d = _data(vocab_size=16, seq_len=400, global_batch_size=8, branching=3)
    tokens = d.global_batch(1)
    counts = torch.zeros(3)
    for a, b in zip(tokens[:, :-1].flatten().tolist(), tokens[:, 1:].flatten().tolist()):
        counts[(d.successors_VC[a] == b).nonzero()[0, 0]] += 1
    assert torch.allclose(counts / counts.sum(), d.probs_C.float(), atol=0.03)


def test_large_vocabulary_is_cheap():
    d = _data(vocab_size=32000, seq_len=2048, global_batch_size=8, branching=4)
    tokens = d.global_batch(1)
    assert tokens.shape == (8, 2049) and int(tokens.max()) < 32000
