"""Run Megatron-Core's own MoE unit tests with te_dist's experts and with SequentialMLP (the control).

Why a control: a test that fails with both arms is a limit of the CPU run (or of the harness);
a test that passes with SequentialMLP and fails with te_dist's experts is a te_dist defect.

    python tests/megatron/upstream_suite.py                     # both arms, 1 and 2 ranks, every file
    python tests/megatron/upstream_suite.py --world-sizes 1 --files test_routers.py -k fp64
    python tests/megatron/upstream_suite.py --markdown          # the per-file table of docs/megatron.md

Every arm and world size is one ``torchrun`` of pytest over the pinned files of the installed
megatron-core release (``upstream/``: core_v0.16.1, ``upstream_0_19/``: core_v0.19.0; ``--release`` to
choose; ``upstream_plugin.py`` does the setup); each rank writes a JUnit report. A test passes when it
passes on every rank, fails when it fails (or errors) on any. Exit status 1 when a test passes with
the control and fails with te_dist, or when a run ends without its reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The pinned test files per megatron-core release (major.minor): each run takes the installed release's.
PINNED = {"0.16": HERE / "upstream", "0.19": HERE / "upstream_0_19"}
PINNED_ENV = "TE_DIST_MCORE_PINNED"  # the chosen directory, handed to the torchrun workers
MOE = "tests/unit_tests/transformer/moe"
FILES = (  # the list: router, dispatchers, MoE layer, grouped/sequential MLP, shared experts,
    f"{MOE}/test_routers.py",  # dispatcher discrepancy, aux losses, and the experts checkpoint tests
    f"{MOE}/test_token_dispatcher.py",
    f"{MOE}/test_a2a_token_dispatcher.py",
    f"{MOE}/test_moe_layer.py",
    f"{MOE}/test_grouped_mlp.py",
    f"{MOE}/test_sequential_mlp.py",
    f"{MOE}/test_shared_experts.py",
    f"{MOE}/test_moe_layer_discrepancy.py",
    f"{MOE}/test_aux_loss.py",
    "tests/unit_tests/dist_checkpointing/models/test_moe_experts.py",
)
ARMS = ("te_dist", "sequential")


def _worker(argv) -> int:
    """One rank: pytest over the pinned files with the plugin, a JUnit report per rank."""
    import pytest

    report_dir, *pytest_args = argv
    rank = os.environ.get("RANK", "0")
    pinned = Path(os.environ[PINNED_ENV])
    os.chdir(pinned)
    return pytest.main([
        "-p", "upstream_plugin", "-p", "no:cacheprovider", "-c", str(pinned / "pytest.ini"),
        "--rootdir", str(pinned), "-q", "-rfEs", f"--junitxml={report_dir}/rank{rank}.xml", *pytest_args,
    ])


def installed_release() -> str:
    """major.minor of the installed megatron-core (from its package metadata: nothing is imported)."""
    from importlib.metadata import version

    return ".".join(version("megatron-core").split(".")[:2])


def pinned_dir(release=None) -> Path:
    """The pinned tests of ``release`` (default: the installed one); a release without a pinned copy raises."""
    release = installed_release() if release is None else release
    if release not in PINNED:
        raise SystemExit(f"no pinned Megatron-Core tests for megatron-core {release}; pinned: {sorted(PINNED)} "
                         f"(tests/megatron/upstream*/README.md says how a release is pinned)")
    return PINNED[release]


def _outcome(case) -> tuple:
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is not None:
            return "failed", (node.get("message") or "")[:300]
    node = case.find("skipped")
    if node is not None:
        return "skipped", (node.get("message") or "")[:300]
    return "passed", ""


def read_reports(report_dir: Path, nproc: int) -> dict:
    """{test id: (outcome, message)} over all ranks; None when a rank left no report."""
    per_test = defaultdict(list)
    for rank in range(nproc):
        path = report_dir / f"rank{rank}.xml"
        if not path.is_file():
            return None
        for case in ET.parse(path).getroot().iter("testcase"):
            file = case.get("file") or case.get("classname", "").replace(".", "/")
            test_id = f"{case.get('classname')}::{case.get('name')}"
            per_test[test_id].append(_outcome(case))
    merged = {}
    for test_id, outcomes in per_test.items():
        failed = [o for o in outcomes if o[0] == "failed"]
        if failed:
            merged[test_id] = failed[0]
        elif all(o[0] == "skipped" for o in outcomes):
            merged[test_id] = outcomes[0]
        else:
            merged[test_id] = ("passed", "")
    return merged


def run_arm(arm: str, nproc: int, files, extra, timeout: float, pinned=None) -> dict:
    """One arm at one world size over ``pinned`` (default: the installed release's pinned tests)."""
    from harness import REPO_ROOT, run_torchrun

    pinned = pinned_dir() if pinned is None else pinned
    with tempfile.TemporaryDirectory(prefix="te_dist_mcore_") as tmp:
        env = {
            "TE_DIST_MCORE_EXPERTS": arm,
            PINNED_ENV: str(pinned),
            "PYTHONPATH": os.pathsep.join(
                [str(pinned), str(HERE), str(REPO_ROOT), str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
            ),
        }
        result = run_torchrun(Path(__file__), nproc, args=("--worker", tmp, *files, *extra), timeout=timeout, env=env)
        merged = read_reports(Path(tmp), nproc)
    if merged is None:
        return {"crashed": result.report()[-8000:]}
    return {"tests": merged}


def file_of(test_id: str) -> str:
    module = test_id.split("::")[0]
    parts = module.split(".")
    # classname is "tests.unit_tests....test_x.TestClass" or "tests....test_x"
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return parts[-1] + ".py" if parts else module


def summarize(results: dict) -> dict:
    """{(file, arm, world): Counter(outcome)}, defects [(world, test id, message)]."""
    table = defaultdict(Counter)
    reasons = defaultdict(Counter)
    defects = []
    for (arm, world), run in results.items():
        for test_id, (outcome, message) in run.get("tests", {}).items():
            table[(file_of(test_id), arm, world)][outcome] += 1
            if outcome == "skipped":
                reasons[(file_of(test_id), arm, world)][message.split(":")[0][:80]] += 1
    for world in {w for _, w in results}:
        ours = results.get(("te_dist", world), {}).get("tests", {})
        control = results.get(("sequential", world), {}).get("tests", {})
        for test_id, (outcome, message) in ours.items():
            if outcome == "failed" and control.get(test_id, ("",))[0] == "passed":
                defects.append((world, test_id, message))
    return {"table": table, "reasons": reasons, "defects": sorted(defects)}


def markdown(results: dict, worlds) -> str:
    s = summarize(results)
    files = sorted({f for f, _, _ in s["table"]})
    head = "| Megatron test file | " + " | ".join(
        f"{'te_dist' if arm == 'te_dist' else 'SequentialMLP'} {w} rank{'s' if w > 1 else ''}"
        for w in worlds for arm in ARMS) + " |"
    lines = [head, "|---" * (1 + 2 * len(worlds)) + "|"]
    for f in files:
        cells = []
        for w in worlds:
            for arm in ARMS:
                c = s["table"].get((f, arm, w), Counter())
                cells.append(f"{c['passed']} passed / {c['failed']} failed / {c['skipped']} skipped")
        lines.append(f"| `{f}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--files", nargs="+", default=None, help="file names (e.g. test_routers.py)")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per arm and world size")
    parser.add_argument("--json", type=Path, default=None, help="write every outcome here")
    parser.add_argument("--markdown", action="store_true", help="print the per-file table")
    parser.add_argument("--release", default=None, choices=sorted(PINNED),
                        help="whose pinned tests to run (default: the installed megatron-core's major.minor)")
    args = parser.parse_args(argv)
    pinned = pinned_dir(args.release)
    print(f"megatron-core {installed_release()} installed; pinned tests: {pinned.name}/", flush=True)
    files = list(FILES)
    if args.files:
        unknown = [f for f in args.files if not any(p.endswith("/" + f) for p in FILES)]
        if unknown:
            parser.error(f"unknown --files {unknown}; expected names from {[Path(p).name for p in FILES]}")
        files = [p for p in FILES if Path(p).name in args.files]
    extra = ["-k", args.k] if args.k else []
    sys.path.insert(0, str(HERE.parent))  # harness.py
    results = {}
    for world in args.world_sizes:
        for arm in args.arms:
            results[(arm, world)] = run_arm(arm, world, files, extra, args.timeout, pinned)
            run = results[(arm, world)]
            counts = Counter(o for o, _ in run.get("tests", {}).values())
            print(f"{arm} world={world}: " + ("CRASHED" if "crashed" in run else str(dict(counts))), flush=True)
            if args.json:  # after every arm, so a run stopped part way keeps what it measured
                args.json.write_text(json.dumps({f"{a}/{w}": r for (a, w), r in results.items()}, indent=1))
    s = summarize(results)
    for (f, arm, w), reasons in sorted(s["reasons"].items()):
        print(f"skipped {f} {arm} world={w}: " + "; ".join(f"{n}x {r}" for r, n in reasons.most_common()))
    for world, test_id, message in s["defects"]:
        print(f"DEFECT world={world} {test_id}: {message}")
    for (arm, world), run in results.items():
        if "crashed" in run:
            print(f"CRASHED {arm} world={world}:\n{run['crashed']}")
    if args.markdown:
        print(markdown(results, args.world_sizes))
    crashed = any("crashed" in run for run in results.values())
    return 1 if (s["defects"] or crashed) else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2:]))
    sys.exit(main())
