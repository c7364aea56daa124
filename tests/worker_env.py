"""Shared start-up of torchrun worker scripts: pick the device for ``--backend`` and join the group.

Workers import it as ``from worker_env import init_worker`` (the harness puts ``tests/`` on PYTHONPATH).
"""

import os

import torch
import torch.distributed as dist

__all__ = ["init_worker"]


def init_worker(backend: str, *, cpu_dtype: torch.dtype, gpu_dtype: torch.dtype):
    """Initialise the default process group; return (device, dtype): cuda:LOCAL_RANK for NCCL, else CPU."""
    if backend == "nccl":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device, dtype = torch.device("cuda", local_rank), gpu_dtype
    else:
        device, dtype = torch.device("cpu"), cpu_dtype
    dist.init_process_group(backend)
    return device, dtype
