"""Timing helpers shared by every benchmark script: how a figure is taken, in one place.

Host figures: ``timeit_us`` (best of repeats of a statement, for calls far under a microsecond),
``cpu_us`` (this process's CPU time, which other jobs on a shared machine inflate little),
``host_us`` (wall time to queue a call, nothing waited for). GPU figures: ``cuda_ms`` (CUDA events
around back-to-back calls), ``interleaved_ms`` (several variants in rotated rounds, so drift hits
them alike), ``graph_ms`` (calls replayed from one CUDA graph: kernels only), ``do_bench_ms``
(Triton's median). ``queued_start`` puts a sample behind the same dense GEMMs every time, so every
variant starts from the same power state and the host runs ahead of the GPU, as in training.

Also the bookkeeping every script shares: ``write_json`` (rows plus the run's meta, atomically) and
``repo_env`` (an environment whose subprocesses import this checkout). Importing this module puts the
checkout first on the path, so a script of it times this checkout's te_dist, not an installed one:
scripts import it before te_dist.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))
PRECONDITION_GEMMS = 6  # dense 8192^3 bf16 GEMMs before every GPU sample (queued_start)

__all__ = ["REPO", "median", "geomean", "timeit_us", "cpu_us", "host_us", "cuda_sync", "cuda_ms", "each_call_ms",
           "interleaved_ms", "queued_start", "busy_host_us", "graph_ms", "do_bench_ms", "hardware", "write_json",
           "add_json_option", "run_subcommand", "repo_env"]


def median(values) -> float:
    return statistics.median(list(values))


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


# ------------------------------------------------------------------------------------------ host time
def timeit_us(stmts, names: dict, number: int, repeats: int, reduce=min) -> list:
    """Per-call time (µs) of each statement string, the best (or ``reduce``) of the repeats, the
    statements alternating inside every repeat (a load spike hits all of them). Statements run with
    ``names`` as globals: no lambda layer is timed."""
    timers = [timeit.Timer(s, globals=names) for s in stmts]
    samples = [[] for _ in stmts]
    for _ in range(repeats):
        for i, t in enumerate(timers):
            samples[i].append(t.timeit(number) / number * 1e6)
    return [reduce(v) for v in samples]


def cpu_us(fn, iters: int, repeats: int, sync=None) -> float:
    """Median over ``repeats`` of the mean process CPU time per call (µs), after a warm-up; ``sync``
    (e.g. torch.cuda.synchronize) ends each repeat, so queued GPU work is paid inside it."""
    for _ in range(max(3, iters // 10)):
        fn()
    if sync:
        sync()
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(iters):
            fn()
        if sync:
            sync()
        samples.append((time.process_time() - start) / iters * 1e6)
    return statistics.median(samples)


def host_us(fn, calls: int, rounds: int = 5, sync=None, warmup: int = 20) -> float:
    """Median over ``rounds`` of the wall time (µs) to queue one call, ``calls`` calls back to back;
    ``sync`` runs before each round and after the last, outside the timed region."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rounds):
        if sync:
            sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    if sync:
        sync()
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------ GPU time
def cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


_HEAT = []  # the preconditioning operand, made on first use
_HOST_SPIN_CYCLES = 40_000_000  # a GPU sleep longer than queueing 20 calls on a slow host


def queued_start():
    """A start event queued behind PRECONDITION_GEMMS dense GEMMs (~8.5 ms on an H200): the host queues
    the calls while the GPU runs them, so a sample times the GPU, from the same power state each time."""
    import torch

    if not _HEAT:
        _HEAT.append(torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16))
    for _ in range(PRECONDITION_GEMMS):
        torch.mm(_HEAT[0], _HEAT[0])
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    return start


def _sample_ms(fn, iters: int, precondition: bool) -> float:
    import torch

    if precondition:
        start = queued_start()
    else:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    end = torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def cuda_ms(fn, *, iters: int = 10, warmup: int = 3, rounds: int = 5, precondition: bool = False) -> float:
    """Median over ``rounds`` of the mean ms per call of ``iters`` back-to-back calls (CUDA events);
    ``precondition``: every round starts behind ``queued_start``'s GEMMs."""
    for _ in range(warmup):
        fn()
    cuda_sync()
    return statistics.median(_sample_ms(fn, iters, precondition) for _ in range(rounds))


def each_call_ms(fn, *, iters: int, warmup: int = 3) -> float:
    """Median over ``iters`` calls queued back to back of each call's own CUDA-event time (ms)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def interleaved_ms(fns: dict, *, iters: int, warmup: int, rounds: int, precondition: bool = True) -> dict:
    """{name: median ms per call}: ``rounds`` rounds, each timing every fn once in a rotated order, each
    sample behind the preconditioning GEMMs, so clock and power drift hit every variant alike."""
    samples = interleaved_samples(fns, iters=iters, warmup=warmup, rounds=rounds, precondition=precondition)
    return {n: statistics.median(v) for n, v in samples.items()}


def paired_ratio(base: list, other: list) -> float:
    """Median over rounds of base/other, each round's pair timed back to back (interleaved_samples): drift
    between rounds cancels, which a ratio of the two medians keeps."""
    return statistics.median(b / o for b, o in zip(base, other))


def interleaved_samples(fns: dict, *, iters: int, warmup: int, rounds: int, precondition: bool = True) -> dict:
    """{name: [ms per call, one per round]}: interleaved_ms's rounds, every sample kept in round order."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    cuda_sync()
    names = list(fns)
    samples = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            samples[n].append(_sample_ms(fns[n], iters, precondition))
    return samples


def busy_host_us(fn, calls: int = 20, rounds: int = 5) -> float:
    """Median host time (µs) to queue one call while the GPU sleeps: nothing waits on the GPU."""
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        torch.cuda._sleep(_HOST_SPIN_CYCLES)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def graph_ms(fn, iters: int, rounds: int = 5):
    """GPU ms per call without host overhead: ``iters`` calls captured in one CUDA graph, the replay
    timed (median of ``rounds``). None when the call cannot be captured."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    except Exception as exc:  # e.g. a compiled function that recompiles under capture
        print(f"  (no CUDA graph: {exc!r:.120})")
        return None
    graph.replay()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def do_bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Triton's ``do_bench`` median (ms): it flushes the L2 between calls."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


# ------------------------------------------------------------------------------------------ bookkeeping
def hardware(device=None) -> str:
    import torch

    if (device is not None and getattr(device, "type", device) == "cpu") or not torch.cuda.is_available():
        return f"CPU ({os.cpu_count()} cores)"
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"


def write_json(path, data, **meta) -> None:
    """Write ``{"meta": {...}, "rows": data}`` (a list) or ``{"meta": {...}, **data}`` (a dict) atomically;
    meta gets the hardware, torch, the UTC date, the git revision and the command line besides ``meta``."""
    if not path:
        return
    import torch

    try:
        revision = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, timeout=10).stdout.strip() or None
        changed = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        if revision and changed:  # a working tree ahead of its HEAD (a device's copy): the revision alone would lie
            revision += "+changes"
    except (OSError, subprocess.SubprocessError):
        revision = None
    base = {"hardware": hardware(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "revision": revision, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    body = dict(data) if isinstance(data, dict) else {"rows": data}
    tmp.write_text(json.dumps({"meta": {**base, **meta}, **body}, indent=1, default=str))
    os.replace(tmp, path)


def add_json_option(*parsers) -> None:
    for parser in parsers:
        parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")


def run_subcommand(parser, runs: dict, script: str, argv=None) -> int:
    """The main() of a script with subcommands: parse, run ``runs[args.what](args)``, write its rows (--json)."""
    args = parser.parse_args(argv)
    rows = runs[args.what](args)
    if rows:
        write_json(args.json, rows, benchmark=f"{script} {args.what}")
    return 0


def repo_env(**extra) -> dict:
    """This process's environment with the checkout first on PYTHONPATH (subprocesses import its te_dist)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env
