"""Regenerate the plots of docs/benchmarks.md from the JSON the benchmarks write.

    python benchmarks/plots.py                      # docs/data/*.json -> docs/img/*.png
    python benchmarks/plots.py --data DIR --out DIR

Inputs (each optional; a missing file skips its plot):
  grouped_gemm.json  ``benchmarks/grouped_gemm.py --json``: forward TFLOP/s per shape and backend
  moe_layer.json     ``benchmarks/moe_layer.py --json``: the MoE layer against its baselines
  grouped_gemm_fp8.json  the same script's output for an FP8 recipe: plotted against the bf16 run

Needs matplotlib (``pip install matplotlib``); nothing else in the project or CI imports it.
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


def grouped_gemm(data: dict, out: Path) -> Path:
    """Grouped-GEMM forward TFLOP/s, one group of bars per shape, one bar per backend."""
    plt = _pyplot()
    rows = data["forward"]
    shapes = [r["shape"] for r in rows]
    width = 0.8 / len(BACKENDS)
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(shapes)), 4.5))
    for i, (key, label) in enumerate(BACKENDS):
        xs = [j + (i - (len(BACKENDS) - 1) / 2) * width for j in range(len(shapes))]
        ax.bar(xs, [r["tflops"].get(key, 0.0) for r in rows], width, label=label)
    ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Grouped GEMM forward ({_subtitle(data.get('meta', {}))})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "grouped_gemm.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def moe_layer(data: dict, out: Path) -> Path:
    """MoE layer step (ms, lower is better) against the per-expert loop, the all-to-all transport and
    the bound of its parts (grouped GEMMs + raw all-to-alls), per (config, EP, tokens)."""
    plt = _pyplot()
    rows = data["rows"]
    labels = [f"{r['config']}\nEP={r['ep']} T={r['tokens']}" for r in rows]
    series = [("layer_ms", lambda r: r.get("transport", "layer")), ("layer_a2a_ms", lambda r: "all_to_all transport"),
              ("loop_ms", lambda r: "per-expert loop"), (None, lambda r: "grouped GEMMs + raw all-to-all")]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(rows)), 4.5))
    for i, (key, name) in enumerate(series):
        values = [(r["gemm_ms"] + r["a2a_ms"]) if key is None else r.get(key, 0.0) for r in rows]
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))]
        label = f"layer ({name(rows[0])} transport)" if key == "layer_ms" else name(rows[0])
        ax.bar(xs, values, width, label=label)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("ms per forward+backward (lower is better)")
    ax.set_title(f"MoE layer step ({_subtitle(data.get('meta', {}))})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "moe_layer.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def fp8_vs_bf16(bf16: dict, fp8: dict, out: Path) -> Path:
    """Our grouped GEMM's forward TFLOP/s per shape: the FP8 run against the bf16 run."""
    plt = _pyplot()
    ours = {r["shape"]: r["tflops"]["auto"] for r in fp8["forward"]}
    shapes = [r["shape"] for r in bf16["forward"] if r["shape"] in ours]
    base = {r["shape"]: r["tflops"]["auto"] for r in bf16["forward"]}
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(shapes)), 4.5))
    ax.bar([j - 0.2 for j in range(len(shapes))], [base[s] for s in shapes], 0.4, label="bf16")
    ax.bar([j + 0.2 for j in range(len(shapes))], [ours[s] for s in shapes], 0.4, label="FP8")
    ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"Grouped GEMM forward, FP8 vs bf16 ({_subtitle(fp8.get('meta', {}))})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "grouped_gemm_fp8.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "docs" / "data")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def load(name):
        path = args.data / name
        return json.loads(path.read_text()) if path.exists() else None

    made = []
    gemm, layer, fp8 = load("grouped_gemm.json"), load("moe_layer.json"), load("grouped_gemm_fp8.json")
    if gemm:
        made.append(grouped_gemm(gemm, args.out))
    if layer:
        made.append(moe_layer(layer, args.out))
    if gemm and fp8:
        made.append(fp8_vs_bf16(gemm, fp8, args.out))
    for path in made:
        print(path)
    return 0 if made else 1


if __name__ == "__main__":
    raise SystemExit(main())
