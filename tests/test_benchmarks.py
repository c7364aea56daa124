"""benchmarks/ as a suite: every script imports and accepts the arguments the suite passes it, the suite
covers every row of the headline table of docs/benchmarks.md, one GPU call fits ten minutes, no script
changes another module's globals, and the docs name only scripts that exist. Nothing is timed."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from module_globals import writes

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
DEVICE_CALL_S = 600  # one device call


def _script(name: str):
    """benchmarks/NAME.py, loaded under a name of its own with its folder on the path only meanwhile."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("timing", None)  # benchmarks/timing.py: not a name for the rest of the session
    return module


def _suite():
    return _script("suite")


def _headline_areas() -> list:
    """The area (link text) of every row of the table under docs/benchmarks.md's '| area |' header."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| area |"))
    areas = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        areas.append(re.match(r"\| \[([^\]]+)\]", line).group(1))
    return areas


def test_at_most_twelve_scripts():
    scripts = sorted(p.name for p in BENCH.glob("*.py"))
    assert len(scripts) <= 12, scripts


def test_the_suite_covers_every_headline_row():
    suite, areas = _suite(), _headline_areas()
    assert len(areas) >= 10 and len(set(areas)) == len(areas), areas
    claimed = {step.area for step in suite.HEADLINE}
    assert set(areas) - claimed == set(), "headline rows no suite step reruns"
    assert claimed - set(areas) == set(), "suite steps naming no headline row"
    gpu_areas = {step.area for step in suite.HEADLINE if step.mode == "gpu"}
    assert {"Grouped GEMM", "Quantization", "FP8 expert MLP", "MoE layer"} <= gpu_areas
    names = [step.json for step in suite.HEADLINE]
    assert len(set(names)) == len(names), "two steps would write one JSON file"


def test_one_gpu_call_fits_ten_minutes():
    suite = _suite()
    for mode in ("gpu", "gpu2"):
        limits = [step.limit_s for step in suite.HEADLINE if step.mode == mode]
        assert sum(limits) <= suite.BUDGET_S[mode] <= DEVICE_CALL_S - 10, (mode, sum(limits))


def test_every_script_imports_and_every_step_parses():
    """In a fresh process (the scripts import as top-level modules): suite.check imports every script of
    benchmarks/ and parses each step's arguments with its script's own parser; a wrong option is caught."""
    code = f"""
import json, sys
sys.path.insert(0, {str(BENCH)!r})
import suite, te_dist
bad = suite.Step("Recipe string", "cpu", "overhead.py", ("recipe", "--no-such-option"), "x.json", 1)
print(json.dumps({{"te_dist": te_dist.__file__, "problems": suite.check(suite.HEADLINE),
                  "bad": suite.check([bad]), "modules": sorted(m for m in sys.modules if m.startswith("bench_"))}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["te_dist"]).resolve().is_relative_to(ROOT), out["te_dist"]  # this checkout's package
    assert out["problems"] == []
    assert len(out["bad"]) == 1 and "--no-such-option" in out["bad"][0]
    assert out["modules"] == sorted(f"bench_{p.stem}" for p in BENCH.glob("*.py"))


ALLOWED_TARGETS = ("os.environ", "sys.path", "sys.modules")  # the process environment; the import system


def test_no_script_assigns_another_modules_globals():
    """The switchboard rule (tests/test_module_globals.py): a benchmark switches a fast path through
    ``te_dist.settings.override`` or a parameter, never by writing (or setattr-ing) an attribute of an
    imported module or of a class imported from one."""
    found = [w.where() for path in sorted(BENCH.glob("*.py")) for w in writes(path)
             if not w.text.startswith(ALLOWED_TARGETS)]
    assert found == []


def test_docs_and_scripts_name_only_existing_benchmarks():
    """Every benchmarks/NAME.py or .sh named in docs/, README.md and the shell scripts exists, unless the
    line calls it retired (finished investigations, kept in git history)."""
    files = [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("tests/**/*.sh"), *BENCH.glob("*.sh")]
    missing = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"benchmarks/([A-Za-z0-9_]+\.(?:py|sh))", line):
                if not (BENCH / name).exists() and "retired" not in line:
                    missing.append(f"{path.relative_to(ROOT)}:{number}: benchmarks/{name}")
    assert missing == []


def test_train_idle_finds_the_gaps_between_device_events():
    """benchmarks/train.py idle: the window from the first kernel's start to the last one's end, and every
    stretch in it where no kernel, copy or memset ran (overlapping events count once)."""
    train = _script("train")
    events = [dict(cat="kernel", name="a", ts=100, dur=50), dict(cat="gpu_memcpy", name="read", ts=120, dur=60),
              dict(cat="cpu_op", name="host", ts=150, dur=400), dict(cat="kernel", name="b", ts=200, dur=10),
              dict(cat="gpu_memset", name="c", ts=205, dur=2), dict(cat="kernel", name="d", ts=260, dur=40)]
    window, idle, gaps = train._gpu_gaps(events)
    assert (window, idle) == (200, 20 + 50)
    assert [(g, start, k["name"]) for g, start, k in gaps] == [(20, 180, "b"), (50, 210, "d")]
    assert train._gpu_gaps([dict(cat="cpu_op", name="host", ts=0, dur=5)]) == (0.0, 0.0, [])


def test_train_throughput_prints_each_job_when_it_ends(monkeypatch, capsys):
    """benchmarks/train.py throughput: a job's row (ratio against the first job's tokens/s) is printed as soon as
    that job ends, so a run stopped by a time limit in a later job still shows the finished ones."""
    import argparse

    train = _script("train")
    jobs = iter([[dict(step=s, tokens_per_s=100.0 * s, loss=5.0 / s) for s in (1, 3, 4)],
                 [dict(step=s, tokens_per_s=125.0 * s, loss=5.0 / s) for s in (1, 3, 4)]])

    def job(out, nproc, *extra):
        rows = next(jobs, None)
        if rows is None:
            raise SystemExit("the third job ran out of time")
        return rows

    monkeypatch.setattr(train, "te_dist_train", job)
    args = argparse.Namespace(variants=["none:1", "current:1", "block:1"], nproc=1, steps=4, config=None,
                              device=None, seed=None, fp8_dense=False)
    with pytest.raises(SystemExit, match="out of time"):
        train.throughput(args)
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("none", "current"))]
    assert [(r[0], r[2], r[4]) for r in rows] == [("none", "350", "1.00"), ("current", "438", "1.25")]


def test_fp8_layer_charges_a_longer_optimizer_step_per_micro_batch():
    """benchmarks/fp8_layer.py ``charged``: the optimizer step's time over bf16's is added per micro-batch (a
    ``:copies`` arm's cast moved into the step), a shorter step is not credited."""
    charged = _script("fp8_layer").charged_speed
    assert charged((12.0, 17.0), 10.0, 21.0, 1) == pytest.approx(12.0 / 14.0)
    assert charged((12.0, 17.0), 10.0, 21.0, 4) == pytest.approx(12.0 / 11.0)
    assert charged((12.0, 17.0), 10.0, 15.0, 1) == pytest.approx(1.2)
