"""Entry point of one training rank: ``torchrun ... -m te_dist.train.worker FLAGS``.

``te-dist train`` starts this under torchrun; ``launchers/train.py`` calls :func:`main` too.
``@record`` writes the rank's traceback where torchrun's failure summary shows it, and torchrun
stops the other ranks as soon as one exits non-zero, so a failing rank ends the job.

SIGINT/SIGTERM are handled from the first line of :func:`main` (te_dist.train.stop): the ranks
stop together at a step boundary and exit 0 at once, without the process-group teardown. A failed
or timed-out collective is reported in one line and ends the process at once: the collective's
thread may still be blocked, and an orderly interpreter exit would wait on it or abort in the
process group's destructor.

Under ``te-dist train`` the rank's stderr goes to its log file (job_files.redirect_stderr), it
marks the phases the launcher's deadlines run from (job_files.RankPhase), and a failure records
its one line and phase; the launcher prints the job's outcome (job_watch.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Optional, Sequence

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from . import job_files
from .stop import StopRequest

__all__ = ["main"]

EXIT_COLLECTIVE_FAILED = 1


@record
def main(argv: Optional[Sequence[str]] = None) -> int:
    stop = StopRequest().install()  # first: from here on a signal stops the job at a step boundary
    job_files.redirect_stderr()
    job_files.mark_ready()
    phase = job_files.RankPhase()

    import torch.distributed as dist

    from ..distributed.bounded import CollectiveError
    from .args import add_train_arguments, check_unknown_flags, config_from_args, fault_from_args, output_options
    from .config import ConfigError
    from .loop import train

    parser = argparse.ArgumentParser(prog="te_dist.train.worker", description="one rank of `te-dist train`",
                                     allow_abbrev=False)
    add_train_arguments(parser)
    ns, extras = parser.parse_known_args(argv)
    check_unknown_flags(parser, extras)
    fault = fault_from_args(ns)
    try:
        cfg = config_from_args(ns)
        result = train(cfg, fault=fault, stop=stop, announce=not ns.from_cli, phase=phase, **output_options(ns))
    except ConfigError as exc:
        print(f"te-dist train: error: {exc}", file=sys.stderr, flush=True)
        job_files.mark_failed(str(exc), phase.where)
        raise
    except CollectiveError as exc:
        _exit_now(exc, phase.where)
    except BaseException as exc:
        job_files.mark_failed(f"{type(exc).__name__}: {exc}", phase.where)
        raise
    if fault is not None:
        fault.at(int(os.environ.get("RANK", "0")), "exit")
    if result.stopped_by is not None:  # every rank is past its last collective; a teardown only delays the stop
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    # Only on success: after a failure, peers may sit in a collective that a destroy would wait on.
    if dist.is_initialized():
        # Free cyclic garbage (modules, quantizers) that may still reference process groups while
        # those groups can be destroyed cleanly; at interpreter shutdown a gloo group's destructor aborts.
        gc.collect()
        dist.destroy_process_group()
    # The interpreter's exit collections walk every object torch created (seconds on a busy machine);
    # frozen objects are skipped. Nothing left needs a collection: files are closed, the group destroyed.
    gc.freeze()
    return 0


def _exit_now(exc: BaseException, phase: str) -> None:
    """One line on stderr, the failure recorded for the launcher and torchrun, then exit (module docstring)."""
    print(f"te-dist train: error: {exc}", file=sys.stderr, flush=True)
    job_files.mark_failed(str(exc), phase)
    ErrorHandler().record_exception(exc)
    sys.stdout.flush()
    os._exit(EXIT_COLLECTIVE_FAILED)


if __name__ == "__main__":
    sys.exit(main())
