"""Settling a bucket's choice on the run's own calls, where its first call could not decide.

Why: a bucket's first call times the candidates on scratch outputs within its budget, which is
too little where one call takes milliseconds (a 7 ms GEMM with 7 candidates: one sample of the
first three, none of the rest), and it times a GPU that has not yet reached its power limit, where
the ranking can differ (docs/kernels.md "Measured choices"). A live call does the run's own work
whichever candidate runs it, so timing it costs only its excess over the fastest (its regret):
the undecided candidates take turns on the bucket's next calls, each call timed between two
events read later without waiting, until each has its samples; then the fastest is kept.
"""

from __future__ import annotations

import collections
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from .bucket_timing import CUT, FIRST_CUT, SLACK, estimate

__all__ = ["SAMPLES", "MAX_SAMPLES", "SAMPLE_MS", "NEAR", "UNTIMED_GUESS", "undecided", "samples_for", "Ratios",
           "Settling"]

SAMPLES, MAX_SAMPLES = 3, 9  # live samples per candidate (its estimate: their median): at least, at most
SAMPLE_MS = 1.0  # a candidate's live samples add up to about this much GPU time (one call is one sample)
NEAR = 1.2  # a candidate the first call timed within this of the fastest is timed live again: the power
# limit of a busy GPU slows tiles and torch's kernel by 0-20% against each other (docs/kernels.md), so
# the first call's order among close ones is the order of a GPU not yet at its limit
UNTIMED_GUESS = 2.0  # a candidate never timed, and never timed in its direction in this process, is
# expected this much slower than the fastest (the slowest tile of the H200 sweep ran 1.9x the
# fastest): what its first sample may cost is held back for it


def undecided(timings: Dict[Hashable, float], candidates: Sequence[Hashable]) -> List:
    """What the live calls should time: the candidates the first call did not time, and those it
    timed within ``NEAR`` of the fastest; [] when the first call's ranking stands (its fastest then
    had no rival left to check). The fastest leads the list."""
    if not timings:
        return []
    fastest = min(timings, key=timings.get)
    rivals = [c for c in candidates if c != fastest and (c not in timings or timings[c] <= NEAR * timings[fastest])]
    if not rivals:
        return []
    return [fastest] + rivals


def samples_for(ms: float) -> int:
    """Live samples per candidate for calls of ``ms``: more where one call is short (its timing is noisier)."""
    return min(MAX_SAMPLES, max(SAMPLES, int(-(-SAMPLE_MS // max(ms, 1e-6)))))


class Ratios:
    """How much slower than its bucket's fastest each candidate ran in the buckets measured so far, per
    direction: what a candidate a bucket has not timed is expected to cost (``guess``).

    Why: on 7 ms GEMMs the first call times two or three of seven candidates; holding 2x the fastest
    (``UNTIMED_GUESS``) for each of the rest left the bucket's remaining 8-18 ms room for one of them
    at a time, and settling ended with candidates never timed, the fastest (4-10% ahead) among them
    (H200, DBRX fc1 at 16 experts, Zipf, 2026-12-03). A candidate's recent record says more: the
    slowest of its last ``WINDOW`` ratios in the same direction (the 64-row tile ran 1.5-1.8x the
    fastest there, the others 1.0-1.4x). A guess it beats costs nothing; one it misses is charged in
    full when its sample is read."""

    WINDOW = 8

    def __init__(self):
        self._seen: Dict[tuple, collections.deque] = {}

    def observe(self, direction: str, ms: Dict[Hashable, float]) -> None:
        """One bucket's estimates (ms per call by candidate)."""
        if len(ms) < 2:
            return
        fastest = min(ms.values())
        for choice, v in ms.items():
            seen = self._seen.get((direction, choice))
            if seen is None:
                seen = self._seen[(direction, choice)] = collections.deque(maxlen=self.WINDOW)
            seen.append(v / max(fastest, 1e-9))

    def guess(self, direction: str, choice: Hashable) -> Optional[float]:
        """Its expected time over the fastest's, or None where it has no record in this direction."""
        seen = self._seen.get((direction, choice))
        return max(seen) if seen else None

    def guesses(self, direction: str, choices) -> Dict[Hashable, float]:
        """{choice: guess} of those of ``choices`` with a record in ``direction``."""
        out = {c: self.guess(direction, c) for c in choices}
        return {c: g for c, g in out.items() if g is not None}


class Settling:
    """One bucket's live timing. ``call(run)`` runs this call on the next candidate due
    (``run(choice)`` makes the call and returns its output) between two clock marks; samples
    are read when their end has passed (``clock.ready``), never waited for. Each candidate gets
    ``samples_for`` the first call's fastest estimate. A candidate is dropped when its estimate is
    clearly slower than the fastest (``FIRST_CUT`` with one or two samples, ``CUT`` with more) or
    its next sample's expected regret no longer fits the allowance; samples queued and not yet read
    hold their expected regret, so calls queued far ahead of the GPU cannot overdraw it. Each read
    sample's regret (its ms over the fastest estimate) is charged to the allowance and to
    ``charge``. Once nothing is due and every sample is read, ``done(ranking, estimates)`` is
    called once with the sampled candidates fastest first; calls meanwhile take the fastest so far.

    ``clock``: ``call(fn) -> (output, handle)``, ``ready(handle)``, ``read(handle) -> ms``.
    ``guesses``: {candidate: expected time over the fastest's} for those the first call did not time
    (``Ratios.guess``); one without a guess is held at ``UNTIMED_GUESS``."""

    def __init__(self, contenders: Sequence[Hashable], first_ms: Dict[Hashable, float], allowance_ms: float,
                 clock, charge: Callable[[float], None], done: Callable[[list, dict], None],
                 guesses: Optional[Dict[Hashable, float]] = None):
        self.contenders = list(contenders)
        self.first_ms = dict(first_ms)  # the first call's estimates (scratch), for an unsampled guess
        self.guesses = dict(guesses or {})
        self.samples: Dict[Hashable, List[float]] = {c: [] for c in self.contenders}
        self.taken = {c: 0 for c in self.contenders}
        self.live = list(self.contenders)
        self.per_candidate = samples_for(min(self.first_ms.values(), default=SAMPLE_MS))
        self.pending = collections.deque()
        self.allowance_ms = allowance_ms
        self.committed_ms = 0.0  # the expected regret of the samples queued and not yet read
        self._clock, self._charge, self._done = clock, charge, done
        self.finished = False

    # ------------------------------------------------------------------ a live call

    def call(self, run: Callable[[Hashable], object]):
        self._read()
        choice, expected = (None, 0.0) if self.finished else self._next()
        if choice is None:
            if not self.pending and not self.finished:
                self._finish()
            return run(self.leader())
        self.taken[choice] += 1
        try:
            out, handle = self._clock.call(lambda: run(choice))
        except Exception:  # noqa: BLE001 - one the first call never ran may fail on this shape: it cannot
            self.live.remove(choice)  # win, and this call is the run's own: the leader makes it
            return run(self.leader())
        self.pending.append((choice, handle, expected))
        self.committed_ms += expected
        return out

    def leader(self) -> Hashable:
        """The fastest so far: by live estimate where sampled, else the first call's."""
        est = self._estimates()
        if est:
            return min(est, key=est.get)
        return self.contenders[0]

    # ------------------------------------------------------------------ bookkeeping

    def _estimates(self) -> Dict[Hashable, float]:
        return {c: estimate(s) for c, s in self.samples.items() if s}

    def _read(self) -> None:
        while self.pending and self._clock.ready(self.pending[0][1]):
            choice, handle, expected = self.pending.popleft()
            self.committed_ms -= expected
            self.samples[choice].append(self._clock.read(handle))
            ms = self.samples[choice][-1]
            regret = max(0.0, ms - min(self._estimates().values()))
            self.allowance_ms -= regret
            self._charge(regret)

    def _next(self) -> Tuple[Optional[Hashable], float]:
        """The candidate due next and its sample's expected regret, or (None, 0.0)."""
        est = self._estimates()
        if est:
            fastest = min(est.values())
            self.live = [c for c in self.live if c not in est
                         or est[c] <= (CUT if len(self.samples[c]) >= SAMPLES else FIRST_CUT) * fastest]
        due = [c for c in self.live if self.taken[c] < self.per_candidate]
        cost = {c: self._expected_regret(c, est) for c in due}
        # round robin: the fewest samples first, and of those the cheapest to sample
        for c in sorted(due, key=lambda c: (self.taken[c], cost[c])):
            expected = cost[c]
            if expected > self.allowance_ms:
                self.live.remove(c)  # it cannot be afforded any more: what it has stands
            elif expected <= self.allowance_ms - self.committed_ms:
                return c, expected  # (samples still out count at what they were expected to cost;
        return None, 0.0  # until they are read, a sample that does not fit beside them waits)

    def _expected_regret(self, c, est) -> float:
        """What a sample may cost over the fastest: from its own estimate (live, else the first call's)
        at ``SLACK`` times (a busy GPU's power limit slows a call by up to ~20% against its estimate,
        and the whole excess is charged), or, for one never timed, its guess (``Ratios``) times the fastest,
        at ``SLACK`` times too, else ``UNTIMED_GUESS`` times the fastest."""
        ref = min(est.values()) if est else min(self.first_ms.values(), default=0.0)
        own = est.get(c, self.first_ms.get(c))
        if own is None:
            guess = self.guesses.get(c)
            return max(0.0, (SLACK * guess if guess is not None else UNTIMED_GUESS) * ref - ref)
        return max(0.0, SLACK * own - ref)

    def _finish(self) -> None:
        self.finished = True
        est = self._estimates()
        self._done(sorted(est, key=est.get), est)

