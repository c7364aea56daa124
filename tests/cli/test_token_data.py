"""Training data from files: token files through a memory map, text through the byte-level token cache,
and batches that are a pure function of (seed, step) whatever the number of ranks."""

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from te_dist.train.config import ConfigError, load_config
from te_dist.train.datasets import build_data, prepare_data
from te_dist.train.text_tokens import END_OF_TEXT
from te_dist.train.token_files import DataError, TokenFile, open_token_file, scan_tokens

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 40


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """The default token cache (te_dist_out/token_cache) lies in the working directory: a fresh one per test."""
    monkeypatch.chdir(tmp_path)


def _cfg(tmp_path, path, **overrides):
    flags = {"data.path": str(path), "train.out_dir": str(tmp_path / "out"), "data.seq_len": 16,
             "data.global_batch_size": 4}
    flags.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config(overrides=flags)


def _tokens_file(tmp_path, tokens, name="tokens.bin", dtype=np.uint16):
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, np.asarray(tokens, dtype=dtype))
    else:
        np.asarray(tokens, dtype=dtype).tofile(path)
    return path


# ------------------------------------------------------------------ token files


@pytest.mark.parametrize("name, dtype", [("t.bin", np.uint16), ("t.bin", np.uint32), ("t.npy", np.int32),
                                         ("t.npy", np.uint16)])
def test_token_files_read_their_windows(tmp_path, name, dtype):
    tokens = np.arange(5000) % 1000
    path = _tokens_file(tmp_path, tokens, name, dtype)
    flags = {"model__vocab_size": 1000}
    if name.endswith(".bin") and dtype == np.uint32:
        flags["data__token_dtype"] = "uint32"
    plan = prepare_data(_cfg(tmp_path, path, **flags))
    assert plan.tokens.num_tokens == 5000 and plan.stats.max_token == 999 and plan.stats.min_token == 0
    assert plan.num_train == 5000 - math.floor(5000 * 0.02)
    assert plan.tokens.read_windows([0, 17, 4983], 17).tolist() == [
        list(range(0, 17)), list(range(17, 34)), [t % 1000 for t in range(4983, 5000)]]
    # uniform counts: the unigram entropy is ln(1000)
    assert plan.stats.unigram_entropy == pytest.approx(math.log(1000), rel=1e-9)


def test_batches_are_windows_of_the_training_part_and_the_validation_tail(tmp_path):
    path = _tokens_file(tmp_path, np.arange(3000))  # each token is its position
    cfg = _cfg(tmp_path, path, model__vocab_size=3000, data__val_fraction=0.1, train__eval_batches=3)
    data = build_data(cfg)
    assert data.num_train == 2700 and data.has_val
    for step in (1, 2, 50):
        x, y = data.local_batch(step, 0, 1)
        assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
        assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the inputs shifted by one
        assert ((x[:, 1:] - x[:, :-1]) == 1).all()  # contiguous windows of the file
    starts = np.concatenate([data.train_starts(s) for s in range(1, 200)])
    assert starts.min() >= 0 and starts.max() + 17 <= 2700  # never reads the held-out tail
    val_starts = [int(data.val_batch(i, 0, 1)[0][:, 0].min()) for i in range(3)]
    assert all(2700 <= s for s in val_starts)
    last = data.val_batch(2, 0, 1)[1]
    assert int(last[-1, -1]) == 2999  # the last window ends at the file's last token
    # the same windows at every evaluation
    assert all(torch.equal(a, b) for a, b in zip(data.val_batch(1, 0, 1), data.val_batch(1, 0, 1)))


def test_sampling_is_a_pure_function_of_seed_and_step_at_any_rank_count(tmp_path):
    """A resume reads the batch the uninterrupted run would have; 1, 2 or 4 ranks read the same global
    batch of each step (each rank its contiguous share), and validation batches likewise."""
    path = _tokens_file(tmp_path, np.random.default_rng(0).integers(0, 300, 20_000))
    cfg = _cfg(tmp_path, path, model__vocab_size=300)
    first, again = build_data(cfg), build_data(cfg)  # a resumed run builds its data anew
    for step in (1, 7, 123):
        assert all(torch.equal(a, b) for a, b in zip(first.local_batch(step, 0, 1), again.local_batch(step, 0, 1)))
        whole_x, whole_y = first.local_batch(step, 0, 1)
        for world in (2, 4):
            shards = [first.local_batch(step, r, world) for r in range(world)]
            assert torch.equal(torch.cat([x for x, _ in shards]), whole_x)
            assert torch.equal(torch.cat([y for _, y in shards]), whole_y)
        val_whole = first.val_batch(0, 0, 1)[0]
        assert torch.equal(torch.cat([first.val_batch(0, r, 2)[0] for r in range(2)]), val_whole)
    assert not torch.equal(first.local_batch(1, 0, 1)[0], first.local_batch(2, 0, 1)[0])
    other_seed = build_data(_cfg(tmp_path, path, model__vocab_size=300, data__seed=99))
    assert not torch.equal(first.local_batch(1, 0, 1)[0], other_seed.local_batch(1, 0, 1)[0])


def test_synthetic_data_keeps_its_batches_and_gains_a_held_out_stream(tmp_path):
    cfg = load_config(overrides={"train.out_dir": str(tmp_path)})
    data = build_data(cfg)
    assert not data.has_val and "Markov chain" in data.describe()
    val = data.val_batch(0, 0, 1)[0]
    assert all(not torch.equal(val, data.local_batch(step, 0, 1)[0]) for step in range(1, 50))
    assert torch.equal(torch.cat([data.val_batch(0, r, 2)[0] for r in range(2)]), val)


# ------------------------------------------------------------------ text and its token cache


def test_text_is_byte_tokens_in_a_cache_reused_and_rebuilt_when_the_text_changes(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    cfg = _cfg(tmp_path, text)
    assert cfg.model.vocab_size == 256  # a text data.path makes byte-level tokens the default vocabulary
    plan = prepare_data(cfg)
    assert plan.cache_state == "built" and "tokenized into" in plan.cache_line()
    cached = tmp_path / "te_dist_out" / "token_cache"  # beside the run directories, not in one
    assert Path(plan.tokens.path).parent.resolve() == cached and plan.tokens.path.endswith(".bin")
    assert np.fromfile(plan.tokens.path, dtype="<u2").tobytes() == np.frombuffer(TEXT.encode(), np.uint8).astype("<u2").tobytes()
    built_at = os.stat(plan.tokens.path).st_mtime_ns

    again = prepare_data(cfg)
    assert again.cache_state == "reused" and "reusing its tokens" in again.cache_line()
    assert os.stat(again.tokens.path).st_mtime_ns == built_at  # not written again
    next_run = prepare_data(_cfg(tmp_path, text, train__out_dir=None))  # a run in a directory of its own
    assert next_run.cache_state == "reused" and next_run.tokens.path == plan.tokens.path

    os.utime(text, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched, same content: still reused
    assert prepare_data(cfg).cache_state == "reused"

    text.write_text(TEXT.replace("times", "TIMES"))  # same size, new content
    changed = prepare_data(cfg)
    assert changed.cache_state == "built" and changed.tokens.path == plan.tokens.path
    assert b"TIMES" in np.fromfile(changed.tokens.path, dtype="<u2").astype(np.uint8).tobytes()
    assert prepare_data(cfg).cache_state == "reused"
    stamp = json.loads(open(changed.tokens.path[: -len(".bin")] + ".json").read())
    assert stamp["num_tokens"] == len(TEXT) and stamp["source"] == str(text.resolve())
    assert not [p.name for p in cached.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_jsonl_documents_end_with_the_end_of_text_byte(tmp_path):
    path = tmp_path / "docs.jsonl"
    docs = [TEXT[:3000], "naïve café " * 20, TEXT[3000:6000]]
    path.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    cfg = _cfg(tmp_path, path, data__cache_dir=str(tmp_path / "elsewhere"))
    plan = prepare_data(cfg)
    assert plan.tokens.path.startswith(str(tmp_path / "elsewhere"))
    expected = b"".join(d.encode() + END_OF_TEXT for d in docs)
    assert np.fromfile(plan.tokens.path, dtype="<u2").astype(np.uint8).tobytes() == expected
    assert plan.stats.max_token == max(expected)


def test_unigram_entropy_of_text(tmp_path):
    path = tmp_path / "ab.txt"
    path.write_bytes(b"aab" * 2000)
    plan = prepare_data(_cfg(tmp_path, path))
    p = np.array([2 / 3, 1 / 3])
    assert plan.stats.unigram_entropy == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-9)
    assert "unigram entropy 0.6365" in build_data(_cfg(tmp_path, path)).describe()


# ------------------------------------------------------------------ bad input: one line naming the file


def _bad(tmp_path, name, content, **flags):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError) as info:
        prepare_data(_cfg(tmp_path, path, **flags))
    message = str(info.value)
    assert message.startswith(f"data.path {path}: ") and "\n" not in message
    return message


def test_bad_files_are_named_with_their_problem(tmp_path):
    assert "no such file" in _bad(tmp_path, "missing.bin", None)
    assert "the file is empty" in _bad(tmp_path, "empty.txt", b"")
    assert "the file is empty" in _bad(tmp_path, "empty.bin", b"")
    assert "3 bytes is not a whole number of uint16 tokens" in _bad(tmp_path, "odd.bin", b"abc")
    assert "is not a whole number of uint32 tokens" in _bad(tmp_path, "six.bin", b"abcdef", data__token_dtype="uint32")
    (tmp_path / "dir.txt").mkdir()
    assert "not a regular file" in _bad(tmp_path, "dir.txt", None)
    assert "too short: 20 tokens" in _bad(tmp_path, "short.txt", b"x" * 20)
    assert "fewer than one batch needs (data.global_batch_size 4 x data.seq_len 16 + 1 = 65)" in _bad(
        tmp_path, "short.bin", np.zeros(50, np.uint16).tobytes(), model__vocab_size=8)
    message = _bad(tmp_path, "nofield.jsonl", b'{"text": "fine"}\n{"body": "no text here"}\n')
    assert 'line 2 has no "text" field' in message
    assert "line 1 is not valid JSON" in _bad(tmp_path, "broken.jsonl", b"{not json\n")
    assert "not a valid .npy file" in _bad(tmp_path, "fake.npy", b"not an npy file at all")
    np.save(tmp_path / "floats.npy", np.zeros(100, np.float32))
    assert "holds float32 values" in _bad(tmp_path, "floats.npy", None)


def test_a_token_beyond_the_vocabulary_names_the_largest_token_and_the_size(tmp_path):
    tokens = np.zeros(4000, np.uint16)
    tokens[1234] = 700
    message = _bad(tmp_path, "big.bin", tokens.tobytes(), model__vocab_size=512)
    assert "its largest token is 700, but model.vocab_size is 512" in message
    assert "--model.vocab_size 701" in message
    text_message = _bad(tmp_path, "t.txt", TEXT.encode(), model__vocab_size=64)
    assert "its largest token is 121, but model.vocab_size is 64 (byte-level tokens of text need 256)" in text_message


def test_a_validation_tail_shorter_than_a_sequence_is_refused(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT[:700])
    message = _bad(tmp_path, "t.txt", None, data__val_fraction=0.01)
    assert "the validation tail (data.val_fraction 0.01 of 700 tokens = 7) is shorter than one sequence" in message
    assert prepare_data(_cfg(tmp_path, path, data__val_fraction=0.0)).num_val == 0


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    """Tests run as root, whom file modes do not stop: the read fails by substitution."""
    from te_dist.train import token_files

    path = tmp_path / "locked.txt"
    path.write_text(TEXT)

    def refuse(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return open(file, *args, **kwargs)

    monkeypatch.setattr(token_files, "open", refuse, raising=False)
    with pytest.raises(DataError, match=r"locked.txt: cannot be read \(Permission denied\)$"):
        prepare_data(_cfg(tmp_path, path))


def test_config_checks_of_the_data_settings(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path x.csv: expected a token file \(.bin, .npy\) or text"):
        load_config(overrides={"data.path": "x.csv"})
    with pytest.raises(ConfigError, match=r"data.val_fraction must be in \[0, 0.5\], got 0.7"):
        load_config(overrides={"data.val_fraction": 0.7})
    with pytest.raises(ConfigError, match=r"data.token_dtype must be one of \['uint16', 'uint32'\]"):
        load_config(overrides={"data.token_dtype": "int8"})
    with pytest.raises(ConfigError, match=r"train.eval_every=5 needs held-out data"):
        load_config(overrides={"data.path": "x.txt", "data.val_fraction": 0, "train.eval_every": 5})
    assert load_config(overrides={"data.path": "x.txt", "model.vocab_size": 300}).model.vocab_size == 300
    assert load_config(overrides={"data.path": "x.bin"}).model.vocab_size == 64


def test_evaluation_schedule():
    t = load_config(overrides={"train.steps": 95}).train
    assert [s for s in range(1, 96) if t.evaluates_at(s, has_val=True)] == [10 * k for k in range(1, 10)] + [95]
    assert not any(t.evaluates_at(s, has_val=False) for s in range(1, 96))  # synthetic data: off unless asked
    t = load_config(overrides={"train.steps": 7, "train.eval_every": 3}).train
    assert [s for s in range(1, 8) if t.evaluates_at(s, has_val=False)] == [3, 6, 7]


# ------------------------------------------------------------------ memory


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_token_file_is_read_without_growing_resident_memory(tmp_path):
    """A sparse 256 MiB token file (no disk used; `benchmarks/train.py token-memory` trains on 1 GiB): its
    full pass and 400 batches of windows spread over all of it leave the process's resident memory
    within 100 MB of where it started (loading it would take 256 MB, as int64 tokens 1 GB)."""
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(1 << 28)
    cfg = _cfg(tmp_path, path, model__vocab_size=64, data__seq_len=256, data__global_batch_size=32)
    before = _rss_bytes()
    data = build_data(cfg)
    assert data.plan.tokens.num_tokens == 1 << 27 and data.plan.stats.max_token == 0
    for step in range(1, 401):
        x, _ = data.local_batch(step, step % 2, 2)
        assert x.shape == (16, 256)
    grown = _rss_bytes() - before
    assert grown < 100e6, f"resident memory grew by {grown / 1e6:.0f} MB"


def test_scan_counts_every_token(tmp_path):
    tokens = np.random.default_rng(1).integers(0, 3000, 10_500)
    path = _tokens_file(tmp_path, tokens)
    stats = scan_tokens(open_token_file(path, "uint16"), chunk_tokens=1000)  # many chunks
    counts = np.bincount(tokens) / len(tokens)
    counts = counts[counts > 0]
    assert (stats.num_tokens, stats.min_token, stats.max_token) == (10_500, int(tokens.min()), int(tokens.max()))
    assert stats.unigram_entropy == pytest.approx(float(-(counts * np.log(counts)).sum()), rel=1e-12)
    assert isinstance(open_token_file(path, "uint16"), TokenFile)
