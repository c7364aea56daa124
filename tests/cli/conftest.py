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


def _run(args, *, cwd, timeout: float = 240, pythonpath_first=None, env=None) -> CliResult:
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath_first, str(REPO_ROOT), env.get("PYTHONPATH")]))
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
    """``run_cli(*args, timeout=..., pythonpath_first=DIR, env={...})`` runs ``te-dist *args`` in a fresh
    temporary directory (``pythonpath_first``: a folder whose modules shadow installed ones, in every
    process; ``env``: variables added to this process's environment)."""

    def run(*args, timeout: float = 240, pythonpath_first=None, env=None) -> CliResult:
        return _run(args, cwd=tmp_path, timeout=timeout,
                    pythonpath_first=str(pythonpath_first) if pythonpath_first else None, env=env)

    return run


@pytest.fixture(scope="module")
def one_rank_runtime():
    """This process as a one-rank gloo job (``te_dist.train.parallel.Runtime``), for in-process
    checkpoint and output-directory tests. Module-scoped and torn down after the module, so tests
    elsewhere in the session see no process group."""
    import socket

    import torch.distributed as dist

    from te_dist.train.parallel import init_runtime

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    patch = pytest.MonkeyPatch()
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for key, value in env.items():
        patch.setenv(key, value)
    runtime = init_runtime(device="cpu", ep_size=1)
    yield runtime
    dist.destroy_process_group()
    patch.undo()


@pytest.fixture
def fake_checkpoint():
    """``fake_checkpoint(out, step, run_id=..., losses=..., **model)``: a step directory as a save
    leaves it (small stand-in files, then a meta.json that lists them), without any rank."""
    import json
    from dataclasses import asdict

    from te_dist.train.checkpoint import checkpoint_dir
    from te_dist.train.config import JobConfig, ModelConfig
    from te_dist.train.manifest import file_digest, write_manifest

    def make(out, step, *, run_id="r1", losses=None, **model):
        path = checkpoint_dir(out, step)
        path.mkdir(parents=True)
        for name in ("__0_0.distcp", ".metadata"):
            (path / name).write_bytes(f"{name} of step {step}".encode())
        config = JobConfig(model=ModelConfig(**model))
        config.train.out_dir = str(out)
        meta = {"step": step, "run_id": run_id, "world_size": 1, "ep": 1, "model": asdict(config.model),
                "config": config.to_dict(), "losses": {str(k): v for k, v in (losses or {}).items()}}
        write_manifest(path, json.loads(json.dumps(meta)), {p.name: file_digest(p) for p in path.iterdir()})
        return path

    return make
