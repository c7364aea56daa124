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
