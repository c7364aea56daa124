"""A process that ran gloo collectives exits 0, not SIGABRT: gloo's threads finish before the interpreter does.

Why: a gloo collective's worker thread ("pt_gloo_runloop") drops its reference to the collective's
tensors just after the waiting caller has been released. When the caller has already dropped its
own references, that last drop frees a Python object and needs the GIL. If the main thread holds
the GIL from there until interpreter finalization (a short tail of Python after the last
collective is enough), the worker thread is still waiting when finalization starts; Python then
ends the thread inside a C++ destructor and the process dies with "terminate called without an
active exception" (SIGABRT) after a run that succeeded; torchrun reports the rank as failed.
Measured on the 2-core CPU box (CI's kind): one 2-rank gloo launch in 10 to 25 aborted this way. Any gloo
job is exposed (``te-dist train`` on CPU, the gloo side groups of NCCL jobs, the test workers).

The fix is to give the GIL away once, after the last collective: a sleep of ``SETTLE_S`` at
interpreter exit (an ``atexit`` hook, registered when ``te_dist.distributed`` is imported; atexit
hooks run before finalization starts) while a process-group thread is alive, which Linux names in
/proc (no /proc: sleep anyway). A worker thread kept off the CPU for longer than the pause can
still lose the race; the pause is about ten scheduler time slices.
"""

from __future__ import annotations

import atexit
import os
import time

__all__ = ["collective_threads_alive", "SETTLE_S"]

SETTLE_S = 0.05
_THREAD_NAME_PARTS = ("gloo", "nccl")  # torch names them pt_gloo_runloop, gloo_tcp_loop, pt_nccl_watchdg...


def collective_threads_alive() -> bool:
    """Whether a gloo or NCCL thread of torch's runs in this process (True where that cannot be read)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        if any(part in name for part in _THREAD_NAME_PARTS):
            return True
    return False


def _settle_at_exit() -> None:
    if collective_threads_alive():
        time.sleep(SETTLE_S)  # releases the GIL: a waiting worker thread drops its last tensors now


atexit.register(_settle_at_exit)
