"""Pictures of training runs, drawn from their ``metrics.jsonl`` and ``config.yaml``.

    <dest>/loss.png        train loss (each step faint, a moving average bold) and validation loss,
                           against steps (left) and against tokens trained on (right)
    <dest>/throughput.png  tokens/s against steps (left); memory (right): the GPU allocator's peak,
                           or the process's peak RSS on CPU

Rank 0 writes them to ``<out>/plots/`` at the end of a run; ``te-dist plot OUT [OUT ...]`` draws
one or several runs on the same axes (bf16 against FP8 on one corpus, say), each labelled by its
directory and recipe, and ``te-dist plot`` alone the newest run under ``te_dist_out/`` (the one
``te_dist_out/latest`` names, run_dirs.py). matplotlib is an optional extra (``pip install -e '.[plot]'``): without it
a run prints how to get the plots and carries on. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .run_dirs import DEFAULT_ROOT, LATEST, latest_run_dir

__all__ = ["PLOTS_DIR", "INSTALL_HINT", "PlotError", "RunSeries", "read_run", "matplotlib_missing", "write_plots",
           "plots_after_run", "default_dest", "runs_to_plot"]

PLOTS_DIR = "plots"
COMPARE_DIR = "te_dist_plots"  # where several runs' plots go unless --to says otherwise
INSTALL_HINT = "pip install -e '.[plot]' (or pip install matplotlib)"
_MEMORY_FIELDS = (("peak_gpu_mem_gib", "GPU memory, allocator peak (GiB)"), ("max_rss_gib", "peak RSS, CPU (GiB)"))


class PlotError(ValueError):
    """A run directory that cannot be plotted; the message names it."""


@dataclass
class RunSeries:
    """One run's curves."""

    label: str
    steps: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    val_steps: list = field(default_factory=list)
    val_loss: list = field(default_factory=list)
    val_tokens: list = field(default_factory=list)
    speed_steps: list = field(default_factory=list)
    tokens_per_s: list = field(default_factory=list)
    memory_label: Optional[str] = None
    memory_steps: list = field(default_factory=list)
    memory: list = field(default_factory=list)


def _config(out: Path) -> dict:
    path = out / "config.yaml"
    if not path.is_file():
        return {}
    try:
        import yaml

        loaded = yaml.safe_load(path.read_text())
    except Exception:  # a label and a token count are all it gives; a damaged file costs only those
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _label(out: Path, config: dict) -> str:
    recipe = config.get("recipe")
    name = recipe.get("type") if isinstance(recipe, dict) else recipe
    run = out.name or str(out)
    return f"{run} ({name})" if name and name != run else run


def read_run(out_dir) -> RunSeries:
    """The curves of the run in ``out_dir``; PlotError when it holds no readable metrics."""
    out = Path(out_dir)
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        raise PlotError(f"{out}: no metrics.jsonl (is it a te-dist train output directory?)")
    rows = {}
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
            rows[int(row["step"])] = row
        except (ValueError, TypeError, KeyError):
            continue  # a line cut short by a crash
    if not rows:
        raise PlotError(f"{out}: metrics.jsonl holds no step yet")
    config = _config(out)
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    per_step = data.get("global_batch_size", 0) * data.get("seq_len", 0) if data else 0
    series = RunSeries(_label(out, config))
    first = min(rows)
    for step in sorted(rows):
        row = rows[step]
        tokens = row.get("tokens") or step * per_step or step
        series.steps.append(step)
        series.loss.append(row["loss"])
        series.tokens.append(tokens)
        if row.get("val_loss") is not None:
            series.val_steps.append(step)
            series.val_loss.append(row["val_loss"])
            series.val_tokens.append(tokens)
        if row.get("tokens_per_s") is not None and step != first:  # the first step pays for warm-up
            series.speed_steps.append(step)
            series.tokens_per_s.append(row["tokens_per_s"])
        for key, label in _MEMORY_FIELDS:
            if row.get(key) is not None:
                series.memory_label = series.memory_label or label
                series.memory_steps.append(step)
                series.memory.append(row[key])
                break
    return series


def matplotlib_missing() -> Optional[str]:
    """None when plots can be drawn here, else what to install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"matplotlib is not installed: {INSTALL_HINT}"
    return None


def _moving_average(values: list, window: int) -> list:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _save(fig, path: Path) -> None:
    """Whole or absent: drawn into a temporary file, then renamed."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=100, format="png")
    tmp.replace(path)


def _loss_figure(runs: Sequence[RunSeries]):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    by_step, by_tokens = fig.subplots(1, 2, sharey=True)
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        window = max(1, len(run.loss) // 25)
        smooth = _moving_average(run.loss, window)
        for ax, x, val_x in ((by_step, run.steps, run.val_steps), (by_tokens, run.tokens, run.val_tokens)):
            if window > 1:
                ax.plot(x, run.loss, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(x, smooth, color=color, linewidth=1.6,
                    label=f"{run.label} train" + (f" (mean of {window})" if window > 1 else ""))
            if run.val_loss:
                ax.plot(val_x, run.val_loss, color=color, linestyle="--", marker="o", markersize=4,
                        label=f"{run.label} validation")
    by_step.set_xlabel("step")
    by_tokens.set_xlabel("tokens trained on")
    by_step.set_ylabel("loss (nats per token)")
    by_step.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.suptitle("loss")
    return fig


def _throughput_figure(runs: Sequence[RunSeries]):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    speed, memory = fig.subplots(1, 2)
    top = 0.0
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        if run.tokens_per_s:
            speed.plot(run.speed_steps, run.tokens_per_s, color=color, linewidth=1.2, label=run.label)
            top = max(top, sorted(run.tokens_per_s)[int(0.98 * (len(run.tokens_per_s) - 1))])
        if run.memory:
            memory.plot(run.memory_steps, run.memory, color=color, linewidth=1.6,
                        label=f"{run.label}: {run.memory_label}")
    if top:
        speed.set_ylim(0, top * 1.15)  # a stray slow or fast step does not flatten the rest
    speed.set_xlabel("step")
    speed.set_ylabel("tokens/s (whole job)")
    memory.set_xlabel("step")
    memory.set_ylabel("GiB (rank 0)")
    memory.set_ylim(bottom=0)
    for ax in (speed, memory):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("throughput and memory")
    return fig


def default_dest(out_dirs: Sequence) -> Path:
    """``<out>/plots`` for one run; ``te_dist_plots`` in the working directory for several."""
    return Path(out_dirs[0]) / PLOTS_DIR if len(out_dirs) == 1 else Path(COMPARE_DIR)


def _named_run(out: Path) -> Path:
    """``out``, or for a ``<root>/latest`` pointer (a symlink, or a file where there are none) the run
    directory it names: the plots are labelled by the run's own name and go into it."""
    if out.name == LATEST and (out.is_symlink() or out.is_file()):
        return latest_run_dir(out.parent) or out
    return out


def runs_to_plot(out_dirs: Sequence, *, root=DEFAULT_ROOT) -> list:
    """``out_dirs`` as given (a ``latest`` pointer as the run it names), or none given: the newest run
    under ``root``; PlotError when there is none."""
    if out_dirs:
        return [_named_run(Path(out)) for out in out_dirs]
    latest = latest_run_dir(root)
    if latest is None:
        raise PlotError(f"no run under {root}/ to plot (run te-dist train first, or name the run: te-dist plot OUT)")
    return [latest]


def write_plots(out_dirs: Sequence, dest=None) -> list:
    """Draw the runs in ``out_dirs`` (one chart each, all runs on it) into ``dest``; the paths written.

    Raises PlotError for a directory without metrics and ImportError without matplotlib."""
    if not out_dirs:
        raise PlotError("no run directory given")
    runs = [read_run(out) for out in out_dirs]  # every directory checked before anything is drawn
    problem = matplotlib_missing()
    if problem is not None:
        raise ImportError(problem)
    dest = Path(dest) if dest is not None else default_dest(out_dirs)
    dest.mkdir(parents=True, exist_ok=True)
    paths = [dest / "loss.png", dest / "throughput.png"]
    for make, path in zip((_loss_figure, _throughput_figure), paths):
        _save(make(runs), path)
    return paths


def plots_after_run(out_dir) -> str:
    """The end-of-run line: where the plots went, or why there are none (never raises: a run that
    trained does not fail over its pictures)."""
    try:
        paths = write_plots([out_dir])
    except ImportError as exc:
        return f"[te-dist] plots: not drawn, {exc}; then: te-dist plot {out_dir}"
    except Exception as exc:
        return f"[te-dist] plots: not drawn ({type(exc).__name__}: {exc}); te-dist plot {out_dir} retries"
    return f"[te-dist] plots: {', '.join(str(p) for p in paths)}"
