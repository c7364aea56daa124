"""Exit right after a gloo collective whose tensors only gloo's worker thread still holds (2 ranks, torchrun).

Rank 0 starts an all-reduce, drops the work handle and the tensor at once, and then keeps the GIL
(no thread switch, no blocking call) until well after rank 1 joined the collective late: gloo's
worker thread finishes the collective and waits for the GIL to free the tensor. Rank 0 then exits
without destroying its group, as a rank leaving on an exception does (a destroy would hand the GIL
over; with one, the same race needs a worker thread preempted past the destroy, as happens on a
loaded machine), so the thread is still waiting when finalization begins.
``--with-te-dist`` imports te_dist.distributed first (its exit hook, te_dist.distributed.exit_settle);
``--without`` does not: the control, which aborts.

    python -m torch.distributed.run --nproc-per-node 2 exit_after_collective.py --with-te-dist
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

PEER_DELAY_S = 0.3  # rank 1 joins the collective this late
HOLD_S = 1.5  # rank 0 keeps the GIL this long after dropping its references


def main() -> None:
    parser = argparse.ArgumentParser()
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--with-te-dist", action="store_true")
    mode.add_argument("--without", action="store_true")
    args = parser.parse_args()
    if args.with_te_dist:
        import te_dist.distributed  # noqa: F401  (registers the exit hook)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    if rank == 0:
        print("RESULT holds_the_gil true", flush=True)  # printing releases the GIL: before, not after
        tensor = torch.ones(1024)
        work = dist.all_reduce(tensor, async_op=True)
        del work, tensor  # gloo's worker thread now holds the only references
        sys.setswitchinterval(1000.0)  # the main thread keeps the GIL through the busy loop below
        end = time.perf_counter() + HOLD_S
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(PEER_DELAY_S)
        tensor = torch.ones(1024)
        dist.all_reduce(tensor)
        print(f"RESULT sum {float(tensor[0])}", flush=True)
    if rank != 0:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
