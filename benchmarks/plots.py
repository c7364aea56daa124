"""Regenerate the plots of docs/benchmarks.md from the JSON the benchmarks write.

    python benchmarks/plots.py                      # docs/data/*.json -> docs/img/*.png
    python benchmarks/plots.py --data DIR --out DIR

Inputs (each optional; a missing file skips its plot):
  grouped_gemm.json  ``benchmarks/grouped_gemm.py --json``: forward TFLOP/s per shape and backend
  moe_layer.json     ``benchmarks/moe_layer.py --json``: the MoE layer against its baselines

Needs matplotlib (``pip install -e '.[plot]'``, also part of the ``test`` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = (("cutlass", "ours (CUTLASS, heuristic tile)"), ("torch", "torch._grouped_mm"), ("loop", "cuBLAS per expert"),
            ("auto", "te_dist.kernels (selected)"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on the benchmark hosts
    import matplotlib.pyplot as plt

    return plt


def _subtitle(meta: dict) -> str:
    return ", ".join(str(meta[k]) for k in ("hardware", "dtype", "torch", "date") if meta.get(k))


def _bars(labels, series, ylabel: str, title: str, path: Path, rotate: bool = True) -> Path:
    """Grouped bars: one group per label, one bar per (legend name, values) of ``series``."""
    plt = _pyplot()
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(labels)), 4.5))
    for i, (name, values) in enumerate(series):
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))], values, width, label=name)
    if rotate:
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    else:
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def grouped_gemm(data: dict, out: Path) -> Path:
    """Grouped-GEMM forward TFLOP/s, one group of bars per shape, one bar per backend."""
    rows = data["forward"]
    series = [(label, [r["tflops"].get(key, 0.0) for r in rows]) for key, label in BACKENDS]
    return _bars([r["shape"] for r in rows], series, "TFLOP/s",
                 f"Grouped GEMM forward ({_subtitle(data.get('meta', {}))})", out / "grouped_gemm.png")


def moe_layer(data: dict, out: Path) -> Path:
    """MoE layer step (ms, lower is better) against the all-to-all transport, the per-expert loop and
    the sum of its parts (grouped GEMMs + raw all-to-alls), per (config, EP, tokens)."""
    rows = data["rows"]
    series = [(f"layer ({rows[0].get('transport', 'auto')} transport)", [r["layer_ms"] for r in rows]),
              ("all_to_all transport", [r.get("layer_a2a_ms", 0.0) for r in rows]),
              ("per-expert loop", [r["loop_ms"] for r in rows]),
              ("grouped GEMMs + raw all-to-all", [r["gemm_ms"] + r["a2a_ms"] for r in rows])]
    labels = [f"{r['config']}\nEP={r['ep']} T={r['tokens']}" for r in rows]
    return _bars(labels, series, "ms per forward+backward (lower is better)",
                 f"MoE layer step ({_subtitle(data.get('meta', {}))})", out / "moe_layer.png", rotate=False)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "docs" / "data")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def load(name):
        path = args.data / name
        return json.loads(path.read_text()) if path.exists() else None

    made = []
    gemm, layer = load("grouped_gemm.json"), load("moe_layer.json")
    if gemm:
        made.append(grouped_gemm(gemm, args.out))
    if layer:
        made.append(moe_layer(layer, args.out))
    for path in made:
        print(path)
    return 0 if made else 1


if __name__ == "__main__":
    raise SystemExit(main())
