"""What ``te-dist train`` decides and checks in the parent process before it starts any rank.

Why this order: the user sees what is being launched (ranks, backend, device, config, output)
within a second, before anything slow (importing torch takes seconds); every check that can fail
then runs before torchrun starts, so a bad job ends with exit code 2 and a message naming what
to change, not with a rank's traceback or an OOM kill.

    plan_launch (no torch: GPUs probed from the driver) -> first_line -> validate -> config
    -> check_gpus (torch, only when GPUs are involved) -> memory estimate -> launch
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Optional

from .config import ConfigError, JobConfig
from .estimate import GiB, MemoryEstimate, available_memory, check_fits, memory_estimate

__all__ = ["LaunchPlan", "probe_gpu_count", "plan_launch", "first_line", "check_gpus", "memory_report",
           "check_logging"]

CPU_DEFAULT_NPROC = 2


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    nproc: int
    device: str  # "cpu" or "cuda"
    nproc_given: bool  # --nproc was on the command line (else derived from the GPUs)

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def probe_gpu_count() -> int:
    """GPUs this process may use, from the driver and ``CUDA_VISIBLE_DEVICES`` (no torch, no CUDA call).

    An estimate for the first line only; :func:`check_gpus` asks torch before anything runs on them.
    """
    root = Path("/proc/driver/nvidia/gpus")
    present = len(list(root.iterdir())) if root.is_dir() else 0
    if not present:
        present = sum(1 for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):  # CUDA stops enumerating at the first invalid entry
            break
        count += 1
    return min(count, present)


def plan_launch(cfg: JobConfig, nproc: Optional[int]) -> LaunchPlan:
    given = nproc is not None
    device = cfg.train.device
    if device == "auto":
        device = "cuda" if probe_gpu_count() > 0 else "cpu"
    if nproc is None:
        gpus = probe_gpu_count()
        nproc = gpus if device == "cuda" and gpus else CPU_DEFAULT_NPROC
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    return LaunchPlan(nproc=nproc, device=device, nproc_given=given)


def first_line(plan: LaunchPlan, *, config: Optional[str], out_dir: str, resume, new_dir: bool = False) -> str:
    """``new_dir``: ``out_dir`` was made for this run (no ``--out``: te_dist.train.run_dirs)."""
    from .. import __version__

    parts = [f"[te-dist] train: {plan.nproc} rank{'s' if plan.nproc != 1 else ''} ({plan.backend}, {plan.device})",
             f"config {config or '(defaults)'}", f"out {out_dir}" + (" (new)" if new_dir else "")]
    if resume:
        parts.append("resume (newest checkpoint in out)" if resume is True else f"resume {resume}")
    parts.append(f"te_dist {__version__}")
    return " | ".join(parts)


def check_gpus(cfg: JobConfig, plan: LaunchPlan) -> tuple:
    """(plan, note): the plan checked against what torch sees (imports torch; call only when GPUs may be used).

    ``note`` says what changed when ``device: auto`` finds no usable GPU after all (a CPU build of torch).
    """
    import torch

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    if cfg.train.device == "cuda" and not available:
        raise ConfigError("train.device='cuda' but no GPU is visible (torch.cuda.is_available() is False)")
    note = None
    if plan.device == "cuda" and not available:  # auto: the driver shows GPUs but this torch cannot use them
        nproc = plan.nproc if plan.nproc_given else CPU_DEFAULT_NPROC
        plan = dataclasses.replace(plan, device="cpu", nproc=nproc)
        note = f"[te-dist] torch sees no GPU (a CPU build?): running {plan.nproc} ranks on cpu (gloo) instead"
    elif plan.device == "cuda" and not plan.nproc_given and plan.nproc != count:
        plan = dataclasses.replace(plan, nproc=count)
        note = f"[te-dist] torch sees {count} GPUs: running {count} ranks"
    if plan.device == "cuda" and plan.nproc > count:
        raise ConfigError(f"--nproc {plan.nproc} needs one GPU per rank, but {count} are visible; "
                          f"use --nproc {count} or --device cpu")
    return plan, note


def _gpu_memory() -> Optional[int]:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def memory_report(cfg: JobConfig, plan: LaunchPlan, *, enforce: bool = True,
                  available: Optional[int] = None) -> str:
    """The estimate line; raises ConfigError when a CPU job cannot fit in the machine's memory.

    ``available`` (bytes) defaults to what the machine can give now (``MemAvailable``).
    """
    estimate: MemoryEstimate = memory_estimate(cfg, plan.nproc, device_type=plan.device)
    line = f"[te-dist] memory per rank (estimate): {estimate.describe()}"
    if plan.device == "cpu":
        available = available_memory() if available is None else available
        if enforce:
            check_fits(estimate, plan.nproc, available)
        if available is not None:
            line += f"; {plan.nproc} ranks: {plan.nproc * estimate.total / GiB:.2f} of {available / GiB:.1f} GiB available"
    else:
        total = _gpu_memory()
        if total is not None:
            line += f" of {total / GiB:.0f} GiB per GPU"
            if estimate.total > total:
                line += " (WARNING: more than the GPU has; expect an out-of-memory error)"
    return line


def check_logging(cfg: JobConfig) -> None:
    if cfg.train.log == "tensorboard":
        from .tensorboard import tensorboard_missing

        problem = tensorboard_missing()
        if problem is not None:
            raise ConfigError(problem)
