"""Entry point of one training rank: ``torchrun ... -m te_dist.train.worker FLAGS``.

``te-dist train`` starts this under torchrun; ``launchers/train.py`` calls :func:`main` too.
``@record`` writes the rank's traceback where torchrun's failure summary shows it, and torchrun
stops the other ranks as soon as one exits non-zero, so a failing rank ends the job.
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Optional, Sequence

from torch.distributed.elastic.multiprocessing.errors import record

__all__ = ["main"]


@record
def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch.distributed as dist

    from .args import add_train_arguments, config_from_args, fault_from_args
    from .config import ConfigError
    from .loop import train

    parser = argparse.ArgumentParser(prog="te_dist.train.worker", description="one rank of `te-dist train`")
    add_train_arguments(parser)
    ns = parser.parse_args(argv)
    try:
        cfg = config_from_args(ns)
        train(cfg, resume=ns.resume, fault=fault_from_args(ns))
    except ConfigError as exc:
        print(f"te-dist train: error: {exc}", file=sys.stderr, flush=True)
        raise
    # Only on success: after a failure, peers may sit in a collective that a destroy would wait on.
    if dist.is_initialized():
        # Free cyclic garbage (modules, quantizers) that may still reference process groups while
        # those groups can be destroyed cleanly; at interpreter shutdown a gloo group's destructor aborts.
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
