"""Worker for the harness self-test: every rank all-reduces its rank and prints the sum."""

import os
import sys

import torch
import torch.distributed as dist

import te_dist.distributed  # noqa: F401  (its exit hook: no SIGABRT after the last gloo collective)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "fail" and rank == 1:
        raise RuntimeError("planned failure on rank 1")
    if mode == "hang" and rank == 1:
        import time

        time.sleep(600)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print(f"rank={rank} world={dist.get_world_size()} sum={t.item():g} local_rank={os.environ['LOCAL_RANK']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
