"""`te-dist train --data.path`: real data end to end (2 gloo ranks started by the command), a bad file
refused before any rank starts, and the plots (or, without matplotlib, how to get them)."""

import json
import math

import pytest

from te_dist.cli import main
from te_dist.train.run_dirs import run_dir_names

pytestmark = pytest.mark.multiprocess

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch of his old house.",
    "A journey of a thousand miles begins with a single step, and every step teaches something new.",
    "In the morning the river was calm; by noon the wind had risen and small waves ran along the shore.",
    "She opened the letter slowly, read it twice, and then laughed until the tears ran down her face.",
    "Numbers, letters and punctuation: 1, 2, 3; a, b, c. Questions? Answers! Quotes \"like this\".",
]
PNG = b"\x89PNG\r\n\x1a\n"


def _corpus(path, repeats=60):
    path.write_text("\n".join(PARAGRAPHS[(i * 3) % len(PARAGRAPHS)] for i in range(repeats * len(PARAGRAPHS))))
    return path


def _rows(out_dir):
    return {row["step"]: row for row in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


def test_text_run_evaluates_plots_and_resumes_bit_exactly(run_cli, tmp_path):
    """Byte-level text: val_loss rows at every eval step and in the progress line, the plots at the end,
    and a run killed at step 5 and resumed from step 3 reads exactly the batches the straight run read."""
    pytest.importorskip("matplotlib")
    _corpus(tmp_path / "corpus.txt")
    common = ("train", "--data.path", "corpus.txt", "--steps", 6, "--ckpt-every", 3, "--train.eval_every", 2,
              "--train.eval_batches", 2, "--log-every", 6)
    straight = run_cli(*common).check().output  # no --out: a run directory of its own under te_dist_out/
    (run_dir,) = run_dir_names(tmp_path / "te_dist_out")
    run = f"te_dist_out/{run_dir.name}"
    assert "[te-dist] data: corpus.txt tokenized into te_dist_out/token_cache/corpus-" in straight
    assert "vocab_size=256" in straight  # byte-level tokens: the default vocabulary for text
    assert "unigram entropy" in straight and "val loss   " in straight
    rows = _rows(run_dir)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert [s for s in rows if "val_loss" in rows[s]] == [2, 4, 6]
    assert all(rows[s]["val_ppl"] == pytest.approx(math.exp(rows[s]["val_loss"])) for s in (2, 4, 6))
    assert rows[6]["tokens"] == 6 * 8 * 32
    assert f"val {rows[4]['val_loss']:.4f} ppl" in straight  # an eval step prints its line
    for name in ("loss.png", "throughput.png"):
        assert (run_dir / "plots" / name).read_bytes().startswith(PNG)
    assert f"[te-dist] plots: {run}/plots/loss.png, {run}/plots/throughput.png" in straight

    crashed = run_cli(*common, "--out", "crashy", "--train.plots", "false", "--fail-rank", 1, "--fail-step", 5)
    assert crashed.returncode != 0
    assert "reusing its tokens in te_dist_out/token_cache/corpus-" in crashed.output  # another run, one cache
    resumed = run_cli(*common, "--out", "crashy", "--train.plots", "false", "--resume").check().output
    assert "[te-dist] data: corpus.txt reusing its tokens in te_dist_out/token_cache/corpus-" in resumed
    assert "resumed from crashy/checkpoints/step_000003 at step 3" in resumed
    again = _rows(tmp_path / "crashy")
    for step in range(1, 7):  # exact float equality: the same batches, the same validation windows
        assert again[step]["loss"] == rows[step]["loss"], step
        assert again[step].get("val_loss") == rows[step].get("val_loss"), step


def test_one_and_two_ranks_train_on_the_same_global_batch_and_plots_never_fail_a_run(run_cli, tmp_path):
    """1 -> 2 ranks: step 1 (the same initial weights) scores the same global batch, up to the order of
    the reductions, also when the two ranks split their rows into micro-batches; the validation after it
    the same windows, with weights one update apart (the gradients were summed in another order). The
    one-rank run has no matplotlib: it still succeeds and says how to get the plots."""
    _corpus(tmp_path / "corpus.txt")
    shadow = tmp_path / "no_matplotlib"
    (shadow / "matplotlib").mkdir(parents=True)
    (shadow / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib (test)')\n")
    common = ("train", "--data.path", "corpus.txt", "--steps", 1, "--recipe", "none", "--no-checkpoint",
              "--train.eval_batches", 2, "--model.aux_loss_coeff", 0)  # no load-balancing loss: a micro-batch's
    # gradient is exactly its share of the batch's (the balance of half a batch is not half the balance)
    without = run_cli(*common, "--nproc", 1, "--out", "one", pythonpath_first=shadow).check().output
    assert ("[te-dist] plots: not drawn, matplotlib is not installed: pip install -e '.[plot]' (or pip install "
            "matplotlib); then: te-dist plot one\n") in without
    assert not (tmp_path / "one" / "plots").exists()
    refused = run_cli("plot", "one", pythonpath_first=shadow, timeout=60)
    assert refused.returncode == 2
    assert refused.output.strip() == ("te-dist plot: error: matplotlib is not installed: pip install -e '.[plot]' "
                                      "(or pip install matplotlib)")
    run_cli(*common, "--nproc", 2, "--out", "two", "--train.plots", "false", "--train.micro_batches", 2).check()
    one, two = _rows(tmp_path / "one")[1], _rows(tmp_path / "two")[1]
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-6, abs=0)
    assert one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-4, abs=0)
    assert abs(one["val_loss"] - one["loss"]) > 1e-3  # not the training batch scored again


@pytest.mark.parametrize("name, content, flags, problem", [
    ("missing.txt", None, (), "no such file"),
    ("empty.bin", b"", (), "the file is empty"),
    ("odd.bin", b"\x01\x00\x02", (), "3 bytes is not a whole number of uint16 tokens"),
    ("short.txt", b"too short", (), "too short: 9 tokens"),
    ("docs.jsonl", b'{"text": "a"}\n{"txt": "b"}\n', (), 'line 2 has no "text" field'),
    ("big.bin", b"\x00\x01" * 400, ("--model.vocab_size", "100"), "its largest token is 256, but model.vocab_size is 100"),
])
def test_a_bad_data_file_exits_2_before_any_rank_starts(tmp_path, monkeypatch, capsys, name, content, flags, problem):
    from te_dist.train import launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a rank was started"))
    if content is not None:
        (tmp_path / name).write_bytes(content)
    assert main(["train", "--data.path", name, *flags]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"te-dist train: error: data.path {name}: ")
    assert problem in errors[0]
    assert run_dir_names(tmp_path / "te_dist_out") == []  # the run directory made for it is gone again


def test_bad_data_from_the_command_line(run_cli, tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 1001)
    result = run_cli("train", "--data.path", "odd.bin", timeout=120)
    assert result.returncode == 2
    assert result.output.strip().splitlines()[-1].startswith(
        "te-dist train: error: data.path odd.bin: 1001 bytes is not a whole number of uint16 tokens")
    assert "ranks (gloo, cpu) | ep=" not in result.output  # no rank started
