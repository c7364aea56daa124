"""The grouped-GEMM wing stays within its line budget (issue 57), so that it cannot creep back.

The wing: ``te_dist/gemm/*.py``, ``te_dist/kernels.py``, ``te_dist/support.py`` and every file in
``cutlass_kernels/``, each counted as ``wc -l`` counts it (newline characters)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 4000


def _wing_files() -> list:
    kernels = [p for p in (ROOT / "cutlass_kernels").iterdir() if p.is_file()]
    return sorted([*(ROOT / "te_dist" / "gemm").glob("*.py"), ROOT / "te_dist" / "kernels.py",
                   ROOT / "te_dist" / "support.py", *kernels])


def test_the_wing_stays_within_its_line_budget():
    counts = {str(p.relative_to(ROOT)): p.read_bytes().count(b"\n") for p in _wing_files()}
    for member in ("te_dist/gemm/entry.py", "te_dist/support.py", "cutlass_kernels/build.py",
                   "cutlass_kernels/grouped_gemm.cu"):
        assert member in counts, f"{member} is not found: the wing's definition no longer matches the tree"
    total = sum(counts.values())
    largest = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:5])
    assert total <= BUDGET, f"the grouped-GEMM wing has {total} lines, over its {BUDGET} (largest: {largest})"
