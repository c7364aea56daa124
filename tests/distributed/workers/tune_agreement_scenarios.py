"""Tuning-table agreement under torchrun (gloo): ranks that measured different winners end up on rank 0's.

Every rank measures the same bucket with a fake timer that makes a rank-dependent choice fastest
(as two GPUs timing within noise of each other would), and a bucket of its own; then all agree.
Prints ``RESULT <name> <json>`` lines that tests/distributed/test_tune_agreement_multiprocess.py compares.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from te_dist.backends import autotune
from te_dist.backends.autotune import Autotuner, MissContext, Settings
from te_dist.backends.selection import Problem
from te_dist.distributed import agree_tuned_choices

CHOICES = [("cutlass", 0), ("torch", None), ("cutlass", 2), ("cutlass", 10)]


def emit(name, **payload):
    print(f"RESULT {name} {json.dumps(payload, sort_keys=True)}", flush=True)


def problem(k):
    return Problem("fwd", "cuda", (9, 0), torch.bfloat16, torch.bfloat16, 8 * 256, k, 2048, 8, True, False, True)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    winner = CHOICES[1 + rank % 3]  # rank 0: torch, rank 1: cutlass:2, ...
    ms = {c: (0.5 if c == winner else 1.0 + i) for i, c in enumerate(CHOICES)}
    timer = lambda fn, calls: ms[fn()]  # noqa: E731
    tuner = autotune.reset(Autotuner(Settings(persist=False), timer=timer, identity=lambda i: ("Fake GPU", 132)))
    context = lambda: MissContext(CHOICES[0], lambda c: (lambda: c), True, True, (0, 2, 10), lambda c: True)  # noqa: E731
    sizes = (256,) * 8
    name = lambda c: None if c is None else autotune.choice_name(c)  # noqa: E731
    shared, own = problem(4096), problem(4096 + 8 * (rank + 1))  # every rank's bucket, and one per rank
    emit("before", shared=name(tuner.choose(shared, 0, sizes, context)), own=name(tuner.choose(own, 0, sizes, context)))
    count = agree_tuned_choices(timeout=60)
    emit("after", count=count, shared=name(tuner.choose(shared, 0, sizes, context)),
         own=name(tuner.choose(own, 0, sizes, context)),
         rank0_own=name(tuner.choose(problem(4096 + 8), 0, sizes, context)),
         new=name(tuner.choose(problem(8192), 0, sizes, context)), frozen=tuner.settings.deterministic)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
