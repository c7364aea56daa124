"""The randomized grouped-GEMM sweep (``benchmarks/grouped_gemm.py --sweep``) on CPU: its shape drawing,
its table and summary, and the ``--dry-run`` of the script (the timing itself needs a GPU)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sweep():
    """benchmarks/grouped_gemm.py under a name of its own, its folder on the path only while it loads."""
    bench = str(ROOT / "benchmarks")
    sys.path.insert(0, bench)
    try:
        spec = importlib.util.spec_from_file_location("bench_grouped_gemm_under_test", Path(bench) / "grouped_gemm.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(bench)
        sys.modules.pop("timing", None)  # benchmarks/timing.py: not a name for the rest of the session
    return module


def test_shapes_come_from_the_seed_within_the_ranges(sweep):
    shapes = sweep.draw_shapes(7, 200)
    assert shapes == sweep.draw_shapes(7, 200) and shapes != sweep.draw_shapes(8, 200)
    for s in shapes:
        assert 1 <= s.num_experts <= 256 and len(s.sizes) == s.num_experts
        assert 512 <= s.k <= 8192 and 512 <= s.n <= 8192 and s.k % 16 == 0 and s.n % 16 == 0
        assert min(s.sizes) >= 0 and 0 < sum(s.sizes) <= 65536
        assert s.num_experts * s.k * s.n * 2 <= 2 * 2 ** 30
    experts = [s.num_experts for s in shapes]
    assert min(experts) < 16 and max(experts) > 128  # the whole range is drawn
    assert any(0 in s.sizes for s in shapes)  # empty experts
    assert any(max(s.sizes) > 4 * sum(s.sizes) / s.num_experts for s in shapes)  # skew
    assert any(sum(s.sizes) < s.num_experts * 4 for s in shapes)  # decode-like
    assert any(sum(s.sizes) > 16384 for s in shapes)


def test_skewed_sizes_sum_and_empty_experts(sweep):
    import random

    sizes = sweep.skewed_sizes(random.Random(0), 32, 100, 1.2, 0.25)
    assert len(sizes) == 32 and sum(sizes) == 3200 and sizes.count(0) >= 8
    even = sweep.skewed_sizes(random.Random(0), 8, 64, 0.0, 0.0)
    assert even == (64,) * 8


def _row(name, raw, torch_ms, auto):
    return {"shape": name, "direction": "fwd", "sizes": [4, 4], "ms": {"raw": raw, "torch": torch_ms, "auto": auto},
            "host_us": {"raw": 10.0, "torch": 12.0, "auto": 13.0}, "pick": "torch static"}


def test_summary_gives_geomeans_worst_rows_and_goal_counts(sweep):
    rows = [_row("a", 1.0, 1.0, 0.5), _row("b", 1.0, 1.25, 2.0), _row("c", 2.0, 2.0, 2.0)]
    lines = sweep.summary_lines(rows, worst=1)
    torch_line, auto_line, host_line = lines
    assert f"geomean raw/torch {(1 * 0.8 * 1) ** (1 / 3):.3f}" in torch_line and "1 under 0.99" in torch_line
    assert "worst 0.800 (b fwd)" in torch_line
    assert f"geomean raw/auto {math.exp((math.log(2) + math.log(0.5)) / 3):.3f}" in auto_line
    assert "1 under 0.95" in auto_line and "worst 0.500 (b fwd)" in auto_line
    assert "median 2.0 us" in host_line
    assert "torch static" in sweep.table_line(rows[0]) and "0.500" in sweep.table_line(rows[1])


def test_summary_gives_the_noise_floor_and_whether_the_torch_path_runs_raws_kernels(sweep):
    """A fourth column times raw's call again (the row's noise floor); ``kernels`` lists each call's GPU kernels."""
    rows = [_row("a", 1.0, 1.0, 1.0), _row("b", 1.0, 1.0, 1.0), _row("c", 1.0, 1.0, 1.0)]
    for row, again, torch_kernels in zip(rows, (0.96, 1.0, 1.02), (["gemm"], ["copy", "gemm"], ["gemm"])):
        row["ms"]["raw again"] = again
        row["kernels"] = {"raw": ["gemm"], "torch": torch_kernels}
    lines = sweep.summary_lines(rows)
    assert "noise floor, the same raw call timed twice: 0.980..1.042 over 3 rows" in lines
    assert "torch path runs raw's GPU kernels and nothing more (torch.profiler): 2 of 3 rows" in lines
    assert f"{1.0 / 0.96:9.3f}" in sweep.table_line(rows[0])
    assert len(sweep.summary_lines([_row("d", 1.0, 1.0, 1.0)])) == 3  # rows without those columns: no such lines


def test_ratios_pair_the_rounds_so_drift_between_rounds_cancels(sweep):
    """Rounds at two clock states: paired, raw/torch is each round's 1/1.1 whatever the medians land on."""
    raw, torch_ms = [1.0, 3.0, 3.0, 1.0, 3.0], [1.1, 3.3, 3.3, 1.1, 3.3]  # both columns drift together
    assert sweep.timing.paired_ratio(raw, torch_ms) == pytest.approx(1 / 1.1)
    row = _row("p", 1.0, 1.0, 1.0)
    row["ratio"] = {"torch": 0.9, "auto": 1.2}
    line = sweep.table_line(row)
    assert "    0.900    1.200" in line and "worst 0.900 (p fwd)" in sweep.summary_lines([row])[0]


def test_the_script_dry_run_prints_the_drawn_shapes_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grouped_gemm.py"), "--sweep", "--dry-run",
                          "--shapes", "5", "--seed", "3"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 5 and all(line.startswith(f"s{i}_") for i, line in enumerate(lines))


def test_the_script_host_cpu_mode_times_our_wrapper_against_raw_torch_without_a_gpu(tmp_path):
    """``--host-cpu``: every column runs on CPU (torch's call and our torch path of each direction, the decision
    on a faked SM 9.0 GPU with and without host sizes) and lands in the JSON with each direction's difference;
    the figures are printed, not judged."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    path = tmp_path / "host.json"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grouped_gemm.py"), "--host-cpu", "--rounds", "1",
                          "--json", str(path)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(path.read_text())
    host = data["host_us"]
    assert set(host) == {"raw", "torch", "dgrad raw", "dgrad torch", "wgrad raw", "wgrad torch", "decide",
                         "decide sizes"}
    assert all(0 < v["best"] <= v["median"] for v in host.values())
    assert set(data["torch_over_raw_us"]) == {"fwd", "dgrad", "wgrad"}
    assert all(f"{d} torch over raw" in out.stdout for d in ("fwd", "dgrad", "wgrad"))
