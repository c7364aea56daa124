"""Plots of runs from their metrics.jsonl: one run or several on the same axes, the newest run when none
is named; without matplotlib a run's end says how to get them and nothing fails."""

import json
import sys

import pytest
import yaml

from te_dist.cli import main
from te_dist.train.plots import (INSTALL_HINT, PlotError, plots_after_run, read_run, runs_to_plot,
                                 write_plots)
from te_dist.train.run_dirs import new_run_dir, point_latest

PNG = b"\x89PNG\r\n\x1a\n"


def _run_dir(path, *, recipe, steps=40, resumed_rows=(), gpu=False, exist_ok=False):
    path.mkdir(parents=True, exist_ok=exist_ok)
    memory = "peak_gpu_mem_gib" if gpu else "max_rss_gib"
    rows = [{"run": "r", "step": s, "loss": 1 / s} for s in resumed_rows]  # lines a resume kept: loss only
    for step in range(len(rows) + 1, steps + 1):
        row = {"run": "r", "step": step, "loss": 5.0 / step + 1, "tokens": 256 * step, "tokens_per_s": 1000.0 + step,
               memory: 0.3 + step / 1000}
        if step % 10 == 0:
            row |= {"val_loss": 5.0 / step + 1.2, "val_ppl": 9.0}
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"run": "r", "step": 4')
    (path / "config.yaml").write_text(yaml.safe_dump({"recipe": recipe, "data": {"global_batch_size": 8, "seq_len": 32}}))
    return path


def test_a_run_reads_into_curves(tmp_path):
    run = read_run(_run_dir(tmp_path / "bf16", recipe="none", resumed_rows=(1, 2)))
    assert run.label == "bf16 (none)"
    assert run.steps == list(range(1, 41)) and run.tokens[:3] == [256, 512, 768]  # from config.yaml for old rows
    assert run.val_steps == [10, 20, 30, 40] and run.val_loss[0] == pytest.approx(1.7)
    assert run.speed_steps[0] == 3  # the first step (warm-up) and rows without speed are left out
    assert run.memory_label.startswith("peak RSS")
    fp8 = read_run(_run_dir(tmp_path / "fp8", recipe={"type": "Float8CurrentScaling"}, gpu=True))
    assert fp8.label == "fp8 (Float8CurrentScaling)" and fp8.memory_label.startswith("GPU memory")


def test_one_run_and_several_runs_on_one_chart(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    bf16 = _run_dir(tmp_path / "bf16", recipe="none")
    fp8 = _run_dir(tmp_path / "fp8", recipe={"type": "Float8CurrentScaling"}, steps=25)
    paths = write_plots([bf16])
    assert paths == [bf16 / "plots" / "loss.png", bf16 / "plots" / "throughput.png"]
    assert all(p.read_bytes().startswith(PNG) and p.stat().st_size > 10_000 for p in paths)
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "bf16", "fp8"]) == 0
    assert (tmp_path / "te_dist_plots" / "loss.png").read_bytes().startswith(PNG)
    assert main(["plot", "bf16", "fp8", "--to", "compare"]) == 0
    assert sorted(p.name for p in (tmp_path / "compare").iterdir()) == ["loss.png", "throughput.png"]
    assert "[te-dist] plots: " in plots_after_run(bf16)


def test_without_a_directory_the_newest_run_is_plotted(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    assert main(["plot"]) == 2
    assert capsys.readouterr().err.strip() == ("te-dist plot: error: no run under te_dist_out/ to plot (run te-dist "
                                               "train first, or name the run: te-dist plot OUT)")
    older, newer = new_run_dir(now=1e9), new_run_dir(now=2e9)
    for run in (older, newer):
        _run_dir(run, recipe="none", exist_ok=True)
    point_latest("te_dist_out", older)  # latest names the run, whatever the names' order
    assert main(["plot"]) == 0
    assert capsys.readouterr().out.split() == [str(older / "plots" / "loss.png"), str(older / "plots" / "throughput.png")]
    assert not (newer / "plots").exists()
    assert main(["plot", "te_dist_out/latest", str(newer), "--to", "both"]) == 0  # latest as the run it names
    assert read_run(runs_to_plot(["te_dist_out/latest"])[0]).label == f"{older.name} (none)"
    (tmp_path / "te_dist_out" / "latest").unlink()
    (tmp_path / "te_dist_out" / "latest").write_text(newer.name + "\n")  # the pointer where symlinks fail
    assert runs_to_plot(["te_dist_out/latest"]) == [newer]


def test_a_directory_without_metrics_is_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlotError, match="empty: no metrics.jsonl"):
        read_run(tmp_path / "empty")
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.strip() == (f"te-dist plot: error: {tmp_path / 'empty'}: no metrics.jsonl "
                                               "(is it a te-dist train output directory?)")


def test_without_matplotlib_nothing_fails(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    run = _run_dir(tmp_path / "run", recipe="none")
    line = plots_after_run(run)
    assert line == f"[te-dist] plots: not drawn, matplotlib is not installed: {INSTALL_HINT}; then: te-dist plot {run}"
    assert not (run / "plots").exists()
    assert plots_after_run(tmp_path / "nowhere").startswith("[te-dist] plots: not drawn (PlotError:")
