"""Multi-process test harness: run a worker script under a real ``torchrun``, capture every rank.

Why a subprocess and not ``mp.spawn``: users launch with torchrun, so the tests exercise the
same rendezvous, environment variables and failure handling. A timeout kills the whole process
group, so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["REPO_ROOT", "TorchrunResult", "run_torchrun", "scenario_results"]

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class TorchrunResult:
    """What one torchrun launch left behind: exit code, launcher output and each rank's log."""

    returncode: int
    timed_out: bool
    launcher_output: str
    rank_logs: dict = field(default_factory=dict)  # rank -> stdout + stderr text

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def log(self, rank: int) -> str:
        return self.rank_logs.get(rank, "")

    def report(self) -> str:
        parts = [f"torchrun returncode={self.returncode} timed_out={self.timed_out}"]
        for rank in sorted(self.rank_logs):
            parts.append(f"----- rank {rank} -----\n{self.rank_logs[rank]}")
        parts.append(f"----- launcher -----\n{self.launcher_output[-6000:]}")
        return "\n".join(parts)

    def check(self) -> "TorchrunResult":
        """Raise with every rank's log unless all ranks exited 0 in time."""
        if not self.ok:
            raise AssertionError(self.report())
        return self


def scenario_results(logs: dict) -> dict:
    """``{scenario: [payload of rank 0, payload of rank 1, ...]}`` from ``RESULT <name> <json>`` lines of
    rank logs (``{rank: text}``); a rank that printed no line for a scenario gets None."""
    results = {}
    for rank in sorted(logs):
        for line in logs[rank].splitlines():
            if line.startswith("RESULT "):
                _, name, payload = line.split(" ", 2)
                results.setdefault(name, {})[rank] = json.loads(payload)
    return {name: [by_rank.get(r) for r in sorted(logs)] for name, by_rank in results.items()}


def _collect_rank_logs(log_dir: Path, nproc: int) -> dict:
    logs = {}
    for rank in range(nproc):
        texts = []
        for name in ("stdout.log", "stderr.log"):
            for path in sorted(log_dir.rglob(f"{rank}/{name}")):
                texts.append(path.read_text(errors="replace"))
        logs[rank] = "".join(texts)
    return logs


def _descendants(pid: int) -> list:
    """All live descendants of ``pid`` (Linux /proc). torchrun starts its workers in sessions of
    their own, so killing torchrun's process group alone would leave hung workers behind."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun, its process group and every worker it started."""
    victims = _descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_torchrun(script, nproc: int, *, args=(), timeout: float = 180, env=None) -> TorchrunResult:
    """Launch ``torchrun --standalone --nproc-per-node nproc script *args`` and wait at most ``timeout`` s."""
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"worker script not found: {script}")
    with tempfile.TemporaryDirectory(prefix="te_dist_torchrun_") as tmp:
        log_dir = Path(tmp) / "logs"
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
            f"--log-dir={log_dir}", "--redirects=3",
            str(script), *map(str, args),
        ]
        child_env = dict(os.environ)
        child_env.setdefault("OMP_NUM_THREADS", "1")
        tests_dir = str(REPO_ROOT / "tests")  # shared worker helpers (worker_env.py)
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), tests_dir, child_env.get("PYTHONPATH")]))
        child_env["PYTHONUNBUFFERED"] = "1"
        if env:
            child_env.update({k: str(v) for k, v in env.items()})
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=child_env, cwd=str(REPO_ROOT), start_new_session=True,
        )
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc.pid)
            out, _ = proc.communicate()
        return TorchrunResult(
            returncode=proc.returncode,
            timed_out=timed_out,
            launcher_output=out or "",
            rank_logs=_collect_rank_logs(log_dir, nproc),
        )
