"""Run the ``te-dist`` command as a user would: a subprocess, with a timeout that kills its group."""

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class CliResult:
    returncode: int
    output: str  # stdout and stderr together, as the user sees them

    def check(self) -> "CliResult":
        if self.returncode != 0:
            raise AssertionError(f"te-dist exited {self.returncode}:\n{self.output[-8000:]}")
        return self


def _run(args, *, cwd, timeout: float = 240) -> CliResult:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    # `python -m te_dist.cli` is exactly what the `te-dist` console script calls (te_dist.cli:main).
    proc = subprocess.Popen(
        [sys.executable, "-m", "te_dist.cli", *map(str, args)], cwd=str(cwd), env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"te-dist {' '.join(map(str, args))} did not finish in {timeout}s (a hang):\n{out[-8000:]}")
    return CliResult(proc.returncode, out)


@pytest.fixture
def run_cli(tmp_path):
    """``run_cli(*args, timeout=...)`` runs ``te-dist *args`` in a fresh temporary directory."""

    def run(*args, timeout: float = 240) -> CliResult:
        return _run(args, cwd=tmp_path, timeout=timeout)

    return run
