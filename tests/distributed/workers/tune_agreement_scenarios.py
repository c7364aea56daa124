"""Tuning-table agreement under torchrun (gloo): ranks that measured different winners end up on rank 0's.

Every rank measures the same bucket with a fake timer that makes a rank-dependent choice fastest
(as two GPUs timing within noise of each other would), and a bucket of its own; then all agree.
Prints ``RESULT <name> <json>`` lines that tests/distributed/test_tune_agreement_multiprocess.py compares.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from te_dist.distributed import agree_tuned_choices
from te_dist.gemm import decide, measure
from te_dist.gemm.decide import Problem
from te_dist.gemm.measure import Tuner, TunerSettings

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
    tuner = measure.reset(Tuner(TunerSettings(persist=False), timer=timer, identity=lambda i: ("Fake GPU", 132)))
    runs = lambda: [(c, lambda c=c: c) for c in CHOICES]  # noqa: E731
    sizes = (256,) * 8

    def choose(p):
        got = tuner.entry(p, 0, sizes, runs)
        return None if got is None else measure.choice_name(decide.pick_measured(got, p))

    shared, own = problem(4096), problem(4096 + 8 * (rank + 1))  # every rank's bucket, and one per rank
    emit("before", shared=choose(shared), own=choose(own))
    count = agree_tuned_choices(timeout=60)
    emit("after", count=count, shared=choose(shared), own=choose(own), rank0_own=choose(problem(4096 + 8)),
         new=choose(problem(8192)), frozen=tuner.settings.deterministic)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
