"""Settling a bucket on the run's own calls (te_dist.backends.live_settling, through the tuner).

A fake clock (ms per choice) stands in for the GPU, so the logic runs on CPU; the GPU side (events
read without waiting, the results of live calls) is in tests/kernels/test_autotune_gpu.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from te_dist.backends import autotune, live_settling
from te_dist.backends.autotune import Autotuner, MissContext, Settings, bucket_key
from te_dist.backends.bucket_timing import SLACK, CallClock
from te_dist.backends.live_settling import UNTIMED_GUESS, Ratios, Settling, undecided
from te_dist.backends.selection import Problem
from fake_timing import FakeTimer

SIZES = (1024,) * 8
C0, C2, C10, TORCH, LOOP = ("cutlass", 0), ("cutlass", 2), ("cutlass", 10), ("torch", None), ("loop", None)
# a 7 ms GEMM: the first call's 35 ms time the static choice and one more, the loop (fastest) not at all
SLOW = {C0: 7.0, TORCH: 7.4, C2: 7.2, C10: 11.0, LOOP: 6.3}


def _p(**kw):
    base = dict(direction="fwd", device_type="cuda", capability=(9, 0), dtype=torch.bfloat16,
                out_dtype=torch.bfloat16, num_rows=8 * 1024, k=6144, n=21504, num_groups=8, sizes_on_host=True)
    base.update(kw)
    return Problem(**base)


def _context():
    return lambda: MissContext(C0, lambda c: (lambda: c), True, True, (0, 2, 10), lambda c: True)


def _tuner(timer, tmp_path=None, **settings):
    s = Settings(persist=tmp_path is not None, directory=tmp_path, **settings)
    t = Autotuner(s, timer=timer, identity=lambda i: ("Fake GPU", 132), file_tag="test")
    t.loop_plans.ms_per_new = dict.fromkeys(t.loop_plans.ms_per_new, 0.1)  # its first call fits the bucket
    return t


def _live(t, p=None, limit=200):
    """Calls of the bucket until it settles; returns the choices its calls ran."""
    ran = []
    for _ in range(limit):
        got = t.choose(p or _p(), 0, SIZES, _context())
        if not isinstance(got, Settling):
            return ran
        ran.append(got.call(lambda c: c))
    raise AssertionError("the bucket did not settle")


class _LateClock:
    """A clock whose samples are ready only when a test says so."""

    def __init__(self):
        self.out = []  # handles not yet ready

    def call(self, fn):
        out = fn()
        handle = {"ms": SLOW[out], "ready": False}
        self.out.append(handle)
        return out, handle

    def ready(self, handle):
        return handle["ready"]

    def read(self, handle):
        assert handle["ready"], "a sample was waited for"
        return handle["ms"]


def test_undecided_lists_the_untimed_and_the_close():
    cands = [C0, TORCH, C2, C10, LOOP]
    timings = {C0: 1.0, TORCH: 1.1, C2: 1.5, C10: 1.19}
    # torch and c10: within 1.2x of the fastest; c2: clearly slower; loop: never timed
    assert undecided(timings, cands) == [C0, TORCH, C10, LOOP]
    assert undecided({TORCH: 1.0, C0: 0.9}, [TORCH, C0]) == [C0, TORCH]  # the fastest leads
    assert undecided({C0: 1.0, TORCH: 2.0}, [C0, TORCH]) == []  # decided
    assert undecided({}, cands) == []


def test_short_calls_take_more_samples():
    assert live_settling.samples_for(7.0) == live_settling.SAMPLES
    assert live_settling.samples_for(0.25) == 4
    assert live_settling.samples_for(0.01) == live_settling.MAX_SAMPLES


def test_a_slow_bucket_settles_on_live_calls_and_finds_the_candidate_its_first_call_missed(tmp_path):
    timer = FakeTimer(SLOW)
    t = _tuner(timer, tmp_path)
    t.choose(_p(k=1024), 0, SIZES, _context())  # another bucket first: the file's first lock and the
    spent_before = t.budget.spent_ms  # kernel module's import take wall time a bucket is charged
    assert t.choose(_p(), 0, SIZES, _context()) == C0  # the first call: what it could time
    key = bucket_key(_p(), SIZES)
    first_timed = set(t.table_for(0).ms[key])  # (the loop's first call, its plans, is not a sample)
    assert "loop" not in first_timed and "cutlass:10" not in first_timed and key in t.table_for(0).settling
    spent_first = t.budget.spent_ms - spent_before
    assert spent_first <= (1 - autotune.LIVE_SHARE) * 50 + 2 * SLOW[C0]  # past its share by the probe at most
    ran = _live(t)
    assert LOOP in ran and C10 in ran  # the untimed ones were tried on live calls
    assert ran.count(C10) == 1  # 1.7x the fastest: dropped after its first sample
    ranking = t.table_for(0).ranking[key]
    assert ranking[0] == LOOP and set(ranking) == set(SLOW)
    assert t.choose(_p(), 0, SIZES, _context()) == LOOP  # settled: a plain choice again
    assert key not in t.table_for(0).settling
    # the live samples cost their excess over the fastest only, within the bucket
    assert t.budget.spent_ms - spent_before <= 50  # no candidate ran past 2x the fastest: no surprise
    entries = json.loads(next(tmp_path.glob("*.json")).read_text())["entries"]
    assert entries[autotune.key_text(key)]["ranking"][0] == "loop"  # the file holds the settled ranking


def test_live_ranking_overrides_a_first_call_that_flattered_a_candidate():
    """The first call ranks C0 ahead of C2 (an unthrottled GPU); on the run's own calls C2 is faster."""
    first = {C0: 7.0, TORCH: 7.7, C2: 7.1, C10: 11.0, LOOP: 9.0}
    steady = {C0: 7.9, TORCH: 8.4, C2: 7.3, C10: 12.0, LOOP: 9.5}

    class Shifting(FakeTimer):
        def __call__(self, fn, calls):
            choice = fn()
            self.calls.append((choice, calls))
            return (steady if self.live else first)[choice]

    timer = Shifting(first)
    timer.live = False
    t = _tuner(timer)
    assert t.choose(_p(), 0, SIZES, _context()) == C0
    timer.live = True
    _live(t)
    assert t.table_for(0).ranking[bucket_key(_p(), SIZES)][0] == C2


def test_a_live_call_returns_its_own_output_and_waits_for_no_sample():
    """Samples not yet ready are read on later calls; while some are out, calls run the fastest so far."""

    clock = _LateClock()
    done = []
    s = Settling([C0, LOOP, TORCH], {C0: 7.0}, 50.0, clock, charge=lambda ms: None,
                 done=lambda ranking, ms: done.append(ranking))
    outs = [s.call(lambda c: ("out", c)[1]) for _ in range(12)]
    assert outs[:3] == [C0, LOOP, TORCH]  # each call's output is its own candidate's
    assert not done and len(clock.out) == 9  # 3 samples each queued, nothing read yet
    assert outs[9:] == [C0] * 3  # nothing due: the leader (the first call's fastest) runs, untimed
    for h in clock.out:
        h["ready"] = True
    s.call(lambda c: c)
    assert done == [[LOOP, C0, TORCH]]


def test_settling_stops_at_its_allowance():
    """A sample is charged its excess over the fastest in full, even past what was expected of it;
    once the allowance is spent nothing more is sampled and the estimates so far decide."""
    surprise = {C0: 7.0, LOOP: 6.3, C10: 15.0}  # c10: 2.4x the fastest, past the guess for an untimed one
    charged, done = [], []
    s = Settling([C0, LOOP, C10], {C0: 7.0}, 8.0, CallClock(FakeTimer(surprise)), charge=charged.append,
                 done=lambda ranking, ms: done.append(ranking))
    ran = [s.call(lambda c: c) for _ in range(8)]
    # c10 was expected at 2x the fastest (6.3 ms over, affordable) and took 8.7 ms over
    assert ran == [C0, LOOP, C10] + [LOOP] * 5
    assert charged == pytest.approx([0.0, 0.0, surprise[C10] - surprise[LOOP]])
    assert s.finished and done == [[LOOP, C0, C10]]


def test_a_sample_is_taken_only_where_a_slower_call_than_its_estimate_still_fits():
    """A busy GPU runs a call up to ~20% over its estimate and the whole excess is charged: a
    candidate timed at 7.2 ms against 7.0 is not sampled on 1.5 ms of allowance (1.2 x 7.2 - 7.0 =
    1.64), where its estimate alone (0.2 ms over) would have let a 9 ms call overdraw it."""
    charged = []
    s = Settling([C0, C2], {C0: 7.0, C2: 7.2}, 1.5, CallClock(FakeTimer({C0: 7.0, C2: 9.0})),
                 charge=charged.append, done=lambda ranking, ms: None)
    ran = [s.call(lambda c: c) for _ in range(6)]
    assert C2 not in ran and sum(charged) <= 1.5
    roomy = Settling([C0, C2], {C0: 7.0, C2: 7.2}, 4.0, CallClock(FakeTimer({C0: 7.0, C2: 8.0})),
                     charge=charged.append, done=lambda ranking, ms: None)
    assert C2 in [roomy.call(lambda c: c) for _ in range(6)]


def test_samples_not_yet_read_hold_their_expected_cost():
    """Live calls run ahead of the GPU: a sample is taken only where what the unread ones were
    expected to cost leaves room for it, and the others wait for those reads."""
    clock = _LateClock()
    s = Settling([C0, C2, C10, LOOP], {C0: 7.0}, 10.0, clock, charge=lambda ms: None,
                 done=lambda ranking, ms: None)
    ran = [s.call(lambda c: c) for _ in range(6)]
    # c2 (never timed: 7 ms expected over) fits beside c0's samples (each held at what a call 20%
    # over its 7 ms estimate would cost: 1.4 ms); c10 and loop wait
    assert ran[:2] == [C0, C2] and C10 not in ran and LOOP not in ran
    held = 7.0 + s.taken[C0] * (SLACK - 1) * 7.0
    assert s.committed_ms == pytest.approx(held) and s.committed_ms <= s.allowance_ms
    for h in clock.out:
        h["ready"] = True
    ran = [s.call(lambda c: c) for _ in range(3)]
    assert C10 in ran or LOOP in ran  # read back: c2 cost 0.2 ms over, the room is there again


def test_a_candidate_with_a_record_is_held_at_its_record_not_at_the_blind_guess():
    """Untimed c2 and c10 ran close to their buckets' fastest before (``Ratios``): each is held at that
    record (1.2 x its ratio x 7 ms, less 7), so both fit beside c0's sample where 2x would fit one;
    the cheapest due is taken first, and the loop, with no record, still waits at 2x."""
    ratios = Ratios()
    ratios.observe("fwd", {C0: 1.0, C2: 1.05, C10: 1.0})
    ratios.observe("fwd", {C0: 2.0, C2: 2.02})  # the slowest of its records counts
    ratios.observe("dgrad", {C0: 1.0, LOOP: 0.9})  # another direction says nothing of fwd
    assert ratios.guess("fwd", C2) == pytest.approx(1.05) and ratios.guess("fwd", C10) == pytest.approx(1.0)
    assert ratios.guess("fwd", LOOP) is None and ratios.guess("fwd", C0) == pytest.approx(1.0)
    guesses = {c: ratios.guess("fwd", c) for c in (C2, C10, LOOP)}
    clock = _LateClock()
    s = Settling([C0, C2, C10, LOOP], {C0: 7.0}, 10.0, clock, charge=lambda ms: None, done=lambda r, ms: None,
                 guesses={c: g for c, g in guesses.items() if g is not None})
    ran = [s.call(lambda c: c) for _ in range(6)]
    assert ran == [C0, C10, C2] * 2  # (c10's guess is below c2's)
    assert s.committed_ms == pytest.approx(2 * ((SLACK - 1) * 7.0 + (SLACK * 1.0 - 1) * 7.0 + (SLACK * 1.05 - 1) * 7.0))
    blind = Settling([C0, C2, C10, LOOP], {C0: 7.0}, 10.0, _LateClock(), charge=lambda ms: None,
                     done=lambda r, ms: None)
    assert blind._expected_regret(C2, {}) == pytest.approx((UNTIMED_GUESS - 1) * 7.0)
    assert [blind.call(lambda c: c) for _ in range(6)][:2] == [C0, C2] and blind.committed_ms < 10.0


def test_records_put_the_likely_fast_untimed_candidate_before_the_likely_slow_one():
    """Two never-timed candidates and room for one blind: c10 (11 ms) listed before the loop (6.3,
    the fastest). Blind, c10 is sampled first, its 4 ms over the fastest is charged, and the loop
    no longer fits; with records (c10 1.6x, the loop 0.95x) the loop goes first and wins."""
    def settle(guesses):
        clock = _LateClock()
        s = Settling([C0, C10, LOOP], {C0: 7.0}, 10.0, clock, charge=lambda ms: None, done=lambda r, ms: None,
                     guesses=guesses)
        ran = []
        for _ in range(40):
            ran.append(s.call(lambda c: c))
            for h in clock.out:  # every sample is read by the next call
                h["ready"] = True
            if s.finished:
                break
        return ran, s.leader()

    ran, leader = settle({})
    assert LOOP not in ran and leader == C0
    ran, leader = settle({C10: 1.6, LOOP: 0.95})
    assert ran.index(LOOP) < 3 and leader == LOOP


def test_the_tuner_records_each_bucket_and_hands_the_records_to_settling():
    """What the first call timed and what live settling measured become records (``Ratios``) of the
    bucket's direction; the next bucket's settling holds its untimed candidates at them."""
    clock = _LateClock()
    t = _tuner(clock)
    t.timer = _BothClock(clock)
    t.choose(_p(), 0, SIZES, _context())
    first = t.table_for(0).settling[bucket_key(_p(), SIZES)]
    untimed = [c for c in first.contenders if c not in first.first_ms]
    assert untimed and first.guesses == {}  # nothing recorded before this bucket
    assert t.ratios.guess("fwd", C0) is not None  # its first call's timings are recorded
    for _ in range(60):
        got = t.choose(_p(), 0, SIZES, _context())
        if not isinstance(got, Settling):
            break
        got.call(lambda c: c)
        for h in clock.out:
            h["ready"] = True
    assert t.ratios.guess("fwd", LOOP) == pytest.approx(1.0)  # live: the loop was the fastest
    other = _p(k=4096)
    t.choose(other, 0, SIZES, _context())
    second = t.table_for(0).settling[bucket_key(other, SIZES)]
    assert set(second.guesses) == {c for c in second.contenders if c not in second.first_ms}
    assert second.guesses[LOOP] == pytest.approx(1.0)
    assert t.ratios.guess("dgrad", LOOP) is None


class _BothClock:
    """The first call's clock (scratch samples read at once, SLOW ms) beside a late clock's live calls."""

    def __init__(self, late):
        self.late = late

    def sample(self, fn, calls):
        return SLOW[fn()]

    def read(self, handle):
        return handle if isinstance(handle, float) else self.late.read(handle)

    def ready(self, handle):
        return self.late.ready(handle)

    def call(self, fn):
        return self.late.call(fn)

    def cover(self, ms):
        pass


def test_a_candidate_that_fails_on_a_live_call_is_dropped_and_the_call_still_made():
    s = Settling([C0, C10, LOOP], {C0: 7.0}, 50.0, CallClock(FakeTimer(SLOW)), charge=lambda ms: None,
                 done=lambda ranking, ms: None)

    def run(c):
        if c == C10:
            raise RuntimeError("cutlass_kernels fwd (config 10) failed: misaligned")
        return c

    ran = [s.call(run) for _ in range(10)]
    assert ran[:3] == [C0, C0, LOOP]  # c10's call was made by the leader (c0, the only one timed)
    assert C10 not in ran and s.taken[C10] == 1 and not s.samples[C10]


def test_no_settling_while_capturing_when_off_or_deterministic(tmp_path):
    t = _tuner(FakeTimer(SLOW))
    t.choose(_p(), 0, SIZES, _context())
    assert isinstance(t.choose(_p(), 0, SIZES, _context()), Settling)
    assert t.choose(_p(capturing=True), 0, SIZES, _context()) == C0  # no timing inside a graph
    t.settings.deterministic = True
    assert t.choose(_p(), 0, SIZES, _context()) is None
    off = _tuner(FakeTimer(SLOW), settle_live=False)
    off.choose(_p(), 0, SIZES, _context())
    assert off.table_for(0).settling == {}
    with pytest.raises(TypeError):
        autotune.configure(settle_live="no")


def test_adopting_rank_zeros_choices_ends_settling():
    t = _tuner(FakeTimer(SLOW))
    t.choose(_p(), 0, SIZES, _context())
    assert t.table_for(0).settling
    t.adopt({"Fake GPU|sm132": {}})
    assert t.table_for(0).settling == {}


def test_a_short_gemm_settles_on_more_samples_at_a_small_cost():
    """A 0.1 ms GEMM: the first call times every candidate, the close ones are timed live again, each
    up to its larger sample count; the live calls cost a fraction of a millisecond."""
    fast = {c: ms / 70 for c, ms in SLOW.items()}
    t = _tuner(FakeTimer(fast))
    assert t.choose(_p(), 0, SIZES, _context()) == LOOP
    settling = t.table_for(0).settling[bucket_key(_p(), SIZES)]
    assert settling.per_candidate == live_settling.samples_for(fast[LOOP]) > live_settling.SAMPLES
    spent = t.budget.spent_ms
    ran = _live(t)
    assert len(settling.samples[LOOP]) == settling.per_candidate and C10 not in ran  # c10 was decided: 1.75x
    assert t.budget.spent_ms - spent < 1.0
    assert t.table_for(0).ranking[bucket_key(_p(), SIZES)][0] == LOOP
