"""Timing one bucket's candidates within its budget: the clocks, the budget and ``measure``.

Why a module of its own: how milliseconds are spent on a GPU (idle clocks, queued rounds, host
stalls, noisy first calls) is a separate concern from what is chosen and remembered
(``autotune``, which calls ``measure`` on a miss and owns the tables and files).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

import torch

__all__ = ["Budget", "CudaClock", "CallClock", "Timer", "as_clock", "estimate", "measure"]

# How one bucket's milliseconds are spent (``measure``): a few ms of untimed calls bring the GPU out of
# its idle clocks (a first call after idle ran 1.2-2.7x slower on H200), then interleaved rounds of one
# timed sample per candidate are queued back to back, the clear losers dropped between rounds so the
# close ones get the later samples. What 50 ms cannot reach: after 25-40 ms of back-to-back GEMMs the
# H200 runs at its power limit, which slows some tiles and torch's kernel by 13-20% and others by 0-6%
# and can reorder them (docs/kernels.md, "Measured choices"); the ranking here is the one of a GPU
# that has not yet reached that limit.
MAX_REPS = 10  # calls per sample, at most
SAMPLE_MS = 0.5  # a sample makes about this much GPU work: its calls = SAMPLE_MS / the probe's ms, 1..MAX_REPS
MAX_ROUNDS = 9
FIRST_CUT = 1.25  # dropped with one or two samples when this much slower than the fastest (a first call may stall)
CUT = 1.08  # dropped with three or more samples (a median) when this much slower
HEAT_MS = 4.0  # untimed calls of the first candidate before the first sample (at most a quarter of the bucket)
COVER_MS = 0.25  # GPU sleep queued after each round: the GPU stays busy while the host plans the next one
SLACK = 1.2  # a round is planned at this many times its estimates: calls later in the bucket run up to
# 13-20% slower than the probe (the power limit, above), and the bucket's wall time is a bound
Timer = Callable[[Callable[[], object], int], float]  # (fn, calls) -> ms per call: a clock that reads at once


class Budget:
    """Timed milliseconds spent measuring by this process; nothing is measured past ``total_ms``."""

    def __init__(self, bucket_ms: float, total_ms: float):
        self.bucket_ms, self.total_ms, self.spent_ms = bucket_ms, total_ms, 0.0

    def left(self) -> float:
        return max(0.0, self.total_ms - self.spent_ms)

    def for_bucket(self) -> float:
        return min(self.bucket_ms, self.left())


_SLEEP_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep counts SM clock cycles; H200 boosts to 1.98 GHz


class CudaClock:
    """Timed samples queued on the current stream, read later: ``sample`` queues ``calls`` calls
    between two events and returns at once, ``read`` waits for that sample's end, ``cover`` queues a
    GPU sleep. Queuing a round whole keeps the GPU busy from one sample to the next, as in training.
    ``call`` times one call whose output is kept (a live call, ``live_settling``); ``ready`` says
    whether a sample's end has passed, without waiting."""

    def call(self, fn: Callable[[], object]):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        return out, (start, end, 1)

    def ready(self, handle) -> bool:
        return handle[1].query()

    def sample(self, fn: Callable[[], object], calls: int):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        return start, end, calls

    def read(self, handle) -> float:
        start, end, calls = handle
        end.synchronize()
        return start.elapsed_time(end) / calls

    def cover(self, ms: float) -> None:
        torch.cuda._sleep(int(ms * _SLEEP_CYCLES_PER_MS))


class CallClock:
    """A clock over a ``Timer`` callable that times at once (tests, benchmarks of the selection logic)."""

    def __init__(self, timer: Timer):
        self.timer = timer

    def sample(self, fn, calls):
        return self.timer(fn, calls)

    def call(self, fn):
        out = []
        ms = self.timer(lambda: out.append(fn()) or out[-1], 1)
        return out[-1], ms

    def ready(self, handle) -> bool:
        return True

    def read(self, handle) -> float:
        return handle

    def cover(self, ms: float) -> None:
        pass


def as_clock(timer):
    return timer if hasattr(timer, "sample") else CallClock(timer)


def estimate(samples: List[float]) -> float:
    """A candidate's ms per call: the median of three or more samples, else the smallest (noise on a
    GPU only ever adds time)."""
    if len(samples) < 3:
        return min(samples)
    return sorted(samples)[(len(samples) - 1) // 2]


def measure(runs: Sequence[Tuple[Hashable, Callable[[], object]]], budget: Budget, timer,
            elapsed_ms: float = 0.0, reserve_ms: float = 0.0) -> Dict[Hashable, float]:
    """{choice: estimated ms per call} of the runs timed within the bucket's budget (charged to ``budget``).
    ``timer``: a clock (``CudaClock``) or a ``Timer`` callable. ``elapsed_ms``: what the bucket already
    spent before this call (the caller's own preparation); it counts against the bucket and is charged.
    ``reserve_ms``: what the bucket keeps for later (live settling): not measured into, not charged.

    A probe call of the first run (after an untimed one) sets the calls per sample (SAMPLE_MS); then
    HEAT_MS of untimed calls of it (none where those two calls were as long: the probe is then that
    run's first sample) bring the GPU out of its idle clocks. Round one queues a sample of every
    run not yet sampled, in order, while the bucket affords it, each after one untimed call where
    the round then takes at most half the bucket; a run that fails is left out (the first one
    re-raises). Each later round drops the runs clearly slower than the fastest estimate
    (FIRST_CUT, CUT) and samples the rest in a rotated order, the fastest first where not all of
    them fit, until one is left, nothing fits, or MAX_ROUNDS, or the wall time since the start plus
    the next round (its GPU work at SLACK times the estimates, and the wall time per round the GPU
    clock did not see so far) passes the bucket. A round is queued whole, with a COVER_MS sleep
    behind it, then read. Charged: the larger of the GPU work and the wall time."""
    clock = as_clock(timer)
    cap = min(budget.for_bucket(), max(0.0, budget.bucket_ms - reserve_ms))
    if not runs or cap <= 0:
        return {}
    t0 = time.perf_counter() - elapsed_ms / 1e3
    fns = dict(runs)
    order = list(fns)
    first = fns[order[0]]
    first()  # untimed: any one-off cost of a first call would otherwise size the samples
    probe = clock.read(clock.sample(first, 1))
    spent = elapsed_ms + 2 * probe
    calls = max(1, min(MAX_REPS, int(SAMPLE_MS / max(probe, 1e-6))))
    if 2 * probe >= HEAT_MS:  # the untimed call and the probe were that much GPU work already
        heat = 0
    else:
        heat = min(max(1, round(HEAT_MS / max(probe, 1e-6))), int(max(0.0, cap - spent) / 4 / max(probe, 1e-6)))
    for _ in range(heat):
        first()
    spent += heat * probe
    samples: Dict[Hashable, List[float]] = {c: [] for c in order}
    if heat == 0 and calls == 1:  # a call as long as the heat, after an untimed one: a sample as round one's
        samples[order[0]].append(probe)  # would be, so round one starts with the next run
    live = list(order)
    rounds_read = 0
    for rnd in range(MAX_ROUNDS):
        estimates = {c: estimate(samples[c]) for c in live if samples[c]}
        if rnd > 0:
            if not estimates:  # every sample of round one failed: the probe stands for the first run
                break
            fastest = min(estimates.values())
            live = [c for c in live if c in estimates
                    and estimates[c] <= (CUT if len(samples[c]) >= 3 else FIRST_CUT) * fastest]
            if len(live) < 2:
                break
            k = rnd % len(live)
            queue = sorted(live, key=estimates.get)  # who is sampled when not all fit
            rotated = live[k:] + live[:k]
        else:
            queue = rotated = [c for c in order if not samples[c]]
        # A first call may pay one-off host costs (a kernel's first load, a library's plan): round one
        # makes one untimed call first where the round then still takes at most half the bucket.
        warm = rnd == 0 and len(queue) * ((calls + 1) * probe) <= cap / 2
        chosen, planned = set(), spent + COVER_MS
        for c in queue:
            cost = (calls + warm) * estimates.get(c, probe) * SLACK
            if planned + cost <= cap:
                chosen.add(c)
                planned += cost
        # the wall clock too: what the GPU clock did not see (host stalls, the host queuing each round
        # while the GPU waits: 1-9 ms over a bucket on H200) is spread over the rounds read so far, and
        # the next round is expected to add as much
        wall = (time.perf_counter() - t0) * 1e3
        unseen = max(0.0, wall - spent) / rounds_read if rounds_read else 0.0
        if not chosen or wall + planned - spent + unseen > cap:
            break
        handles = []
        for c in rotated:
            if c not in chosen:
                continue
            try:
                if warm:
                    fns[c]()
                handles.append((c, clock.sample(fns[c], calls)))
            except Exception:  # noqa: BLE001 - a candidate that fails on this shape cannot win
                live.remove(c)  # (the first one ran in the probe: a failure of it raised there)
        clock.cover(COVER_MS)
        spent += COVER_MS
        for c, h in handles:
            ms = clock.read(h)
            spent += (calls + warm) * ms
            samples[c].append(ms)
        rounds_read += 1
    budget.spent_ms += max(spent, (time.perf_counter() - t0) * 1e3)  # the wall time where it was longer
    out = {c: estimate(samples[c]) for c in order if samples[c]}
    if not out:  # the probe alone filled the bucket: it is still a measurement of the first run
        out[order[0]] = probe
    return out
