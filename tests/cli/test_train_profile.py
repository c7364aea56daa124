"""benchmarks/train.py profile runs the job's step on CPU (the script's check; its figures are for GPUs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_profile_sums_kernel_time_by_kind_per_recipe(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train.py"), "profile", "--config",
                           str(ROOT / "launchers" / "configs" / "tiny_cpu.yaml"), "--recipes", "none,current",
                           "--device", "cpu", "--steps", "1", "--warmup", "1", "--top", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = {row["recipe"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(data) == {"none", "current"}
    for recipe in data.values():
        assert recipe["ms_per_step"] > 0 and len(recipe["top_ms"]) == 3
        assert sum(recipe["kinds_ms"].values()) > 0
    assert data["current"]["kinds_ms"].get("cast", 0) > 0  # the FP8 recipe quantizes; bf16 casts nothing of its own
    for recipe in data.values():  # the host's split: on CPU nothing runs apart from the host, so it mostly works
        assert recipe["host_working_ms"] > 0 and 0 <= recipe["host_waiting_ms"] < recipe["host_working_ms"]
    assert "host (cProfile):" in proc.stdout


def test_host_split_counts_the_calls_that_wait_for_the_gpu_as_waiting():
    """The time a step spends in a function named like a synchronize (its own time, as a CUDA event's wait is the
    builtin's own) is waiting; the rest of its time is working."""
    import time

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from train import host_split
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def synchronize():  # stands in for Event.synchronize: 20 ms spent in the call itself
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass

    def step():
        end = time.perf_counter() + 0.01
        while time.perf_counter() < end:  # host work
            pass
        synchronize()

    working, waiting = host_split(step, lambda: None, 3)
    assert working > 5 and 0.5 < waiting / (working + waiting) < 0.85, (working, waiting)  # ~10 ms and ~20 ms a step


def test_kernel_kinds_file_casts_as_casts_though_their_names_carry_fp8_types():
    """A cast kernel's signature names its FP8 type (it used to count as an FP8 GEMM); GEMMs keep their kinds."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from train import kind_of
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    casts = ["void (anonymous namespace)::cast_rowcol_kernel<__nv_bfloat16, (__nv_fp8_interpretation_t)1, false>(...)",
             "void (anonymous namespace)::cast_blocks_kernel<__nv_bfloat16, (__nv_fp8_interpretation_t)0>(...)",
             "_transpose_bytes_kernel", "_amax_kernel", "_cast_tile_kernel"]
    assert [kind_of(name) for name in casts] == ["cast"] * len(casts)
    assert kind_of("_scaled_swiglu_forward_fp8_rows") == kind_of("triton_poi_fused_mul_silu_split_0") == "swiglu"
    assert kind_of("nvjet_sm90_qqtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT") == "fp8 gemm"
    assert kind_of("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversal...NS_12float_e4m3_tE...") == "fp8 gemm"
    assert kind_of("_ZN7cutlass13device_kernel...16Sm90RowBroadcastILi0E...NS_12float_e4m3_tE...") == "fp8 gemm"
    assert kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"


def test_switch_times_the_job_step_with_a_setting_off_and_on(tmp_path):
    """The A/B of a switch in the job's step, the value in force first (here off, by the environment; its figures
    are for GPUs; on CPU the path may not apply)."""
    out = tmp_path / "switch.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train.py"), "switch", "--setting", "fp8_head_loss", "--config",
           str(ROOT / "launchers" / "configs" / "tiny_cpu.yaml"), "--recipes", "current", "--device", "cpu",
           "--rounds", "2", "--steps", "1", "--warmup", "1", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TE_DIST_FP8_HEAD_LOSS="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["recipe"], r["setting"]) for r in rows] == [("none", None), ("current", False), ("current", True)]
    assert all(r["ms_per_step"] > 0 for r in rows) and rows[0]["over_bf16"] == 1.0
    assert rows[2]["on_over_off"] == rows[1]["ms_per_step"] / rows[2]["ms_per_step"]
    bad = subprocess.run(cmd[:4] + ["fp8_tile", "--device", "cpu"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env)
    assert bad.returncode != 0 and "boolean or integer field of te_dist.settings, got 'fp8_tile'" in bad.stderr
    no_values = subprocess.run(cmd[:4] + ["cuda_block_cast_launch", "--device", "cpu"], capture_output=True, text=True,
                               timeout=120, cwd=ROOT, env=env)
    assert no_values.returncode != 0 and "integer field: give --values" in no_values.stderr


def test_switch_times_an_integer_setting_at_each_value_the_value_in_force_first(tmp_path):
    out = tmp_path / "switch.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train.py"), "switch", "--setting", "cuda_block_cast_launch",
           "--values", "1,0,1", "--config", str(ROOT / "launchers" / "configs" / "tiny_cpu.yaml"), "--recipes", "block",
           "--device", "cpu", "--rounds", "1", "--steps", "1", "--warmup", "1", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TE_DIST_CUDA_BLOCK_CAST_LAUNCH="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["recipe"], r["setting"]) for r in rows] == [("none", None), ("block", 0), ("block", 1)]
    assert rows[1]["on_over_off"] is None and rows[2]["on_over_off"] == rows[1]["ms_per_step"] / rows[2]["ms_per_step"]
    bad = subprocess.run(cmd[:6] + ["0,x", "--device", "cpu"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=env)
    assert bad.returncode != 0 and "comma-separated integers, got '0,x'" in bad.stderr
