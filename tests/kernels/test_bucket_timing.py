"""Timing one bucket's candidates (te_dist.backends.bucket_timing): rounds, cuts, the budget, failures.

A fake clock (a table of ms per choice, tests/kernels/fake_timing.py) stands in for the GPU, so the
timing logic runs on CPU; GPU timing itself is covered by tests/kernels/test_autotune_gpu.py.
"""

from __future__ import annotations

import time

from te_dist.backends import bucket_timing
from te_dist.backends.bucket_timing import Budget, measure
from fake_timing import MS, FakeTimer


def test_measure_keeps_every_timing_and_charges_the_budget():
    timer = FakeTimer(MS)
    budget = Budget(bucket_ms=50, total_ms=2000)
    runs = [(c, (lambda c=c: c)) for c in MS]
    got = measure(runs, budget, timer)
    assert got == MS
    probe_calls = [n for c, n in timer.calls[:1]]
    assert probe_calls == [1]
    calls = {n for _, n in timer.calls[1:]}
    assert len(calls) == 1 and 1 <= calls.pop() <= bucket_timing.MAX_REPS
    assert 0 < budget.spent_ms <= 50 + 2 * MS[("cutlass", 0)]

def test_measure_stops_at_the_bucket_budget():
    slow = {c: 10.0 for c in MS}  # 10 ms per call: a probe plus one timed call per candidate = 20 ms
    budget = Budget(bucket_ms=50, total_ms=2000)
    got = measure([(c, (lambda c=c: c)) for c in slow], budget, FakeTimer(slow))
    assert 1 <= len(got) < len(slow)
    assert list(got) == list(slow)[:len(got)]  # the first ones (static, torch) are timed first
    assert budget.spent_ms <= 50 + 20  # at most one run past the cap
    assert measure([(c, (lambda c=c: c)) for c in slow], Budget(50, 0), FakeTimer(slow)) == {}

def test_a_candidate_that_fails_is_skipped_not_raised():
    def timer(fn, calls):
        choice = fn()
        if choice == ("cutlass", 10):
            raise RuntimeError("cutlass_kernels fwd (config 10) failed: misaligned")
        return MS[choice]

    got = measure([(c, (lambda c=c: c)) for c in MS], Budget(50, 2000), timer)
    assert ("cutlass", 10) not in got and got[("cutlass", 2)] == MS[("cutlass", 2)]

def test_a_flattering_first_sample_is_outvoted_by_the_later_rounds():
    """One sample that flatters a tile (noise on its first timing) does not decide: the close
    contenders are sampled again in interleaved rounds and ranked by their median."""
    first = {("cutlass", 0): 0.050, ("cutlass", 2): 0.060, ("torch", None): 0.080}  # c0 looks fastest once
    steady = {("cutlass", 0): 0.060, ("cutlass", 2): 0.055, ("torch", None): 0.080}
    seen = []

    def timer(fn, calls):
        choice = fn()
        seen.append(choice)
        return (first if seen.count(choice) == (2 if choice == ("cutlass", 0) else 1) else steady)[choice]

    runs = [(c, (lambda c=c: c)) for c in first]
    budget = Budget(bucket_ms=50, total_ms=2000)
    got = measure(runs, budget, timer)
    assert min(got, key=got.get) == ("cutlass", 2)
    assert got[("cutlass", 0)] == steady[("cutlass", 0)]  # the median of its samples, not the flattering one
    assert seen.count(("torch", None)) == 1  # 1.45x the fastest after one sample: dropped
    assert seen.count(("cutlass", 2)) >= 3
    assert budget.spent_ms <= 50

def test_rounds_are_interleaved_in_a_rotated_order():
    ms = {("cutlass", 0): 0.05, ("cutlass", 2): 0.05, ("torch", None): 0.05}
    timer = FakeTimer(ms)
    measure([(c, (lambda c=c: c)) for c in ms], Budget(bucket_ms=50, total_ms=2000), timer)
    seq = [c for c, _ in timer.calls[1:]]  # after the probe
    rounds = [tuple(seq[i:i + 3]) for i in range(0, len(seq) - 2, 3)]
    assert len(rounds) >= 3 and all(len(set(r)) == 3 for r in rounds)  # every round samples each once
    assert len({r[0] for r in rounds}) == 3  # and starts with a different one

def test_expensive_calls_reach_every_candidate_and_spend_the_rest_on_the_close_ones():
    """3-4 ms calls (a wgrad of 64 experts, 64 rows each): the candidate listed last is still timed,
    the clear losers once only, and the winner is the fastest, all within the bucket."""
    ms = {("cutlass", 0): 3.89, ("torch", None): 3.74, ("cutlass", 1): 5.61, ("cutlass", 2): 4.28,
          ("cutlass", 3): 3.61, ("cutlass", 10): 5.13, ("loop", None): 3.45}
    timer = FakeTimer(ms)
    budget = Budget(bucket_ms=50, total_ms=2000)
    got = measure([(c, (lambda c=c: c)) for c in ms], budget, timer)
    assert set(got) == set(ms) and min(got, key=got.get) == ("loop", None)
    counts = {c: sum(1 for t, _ in timer.calls if t == c) for c in ms}
    assert counts[("cutlass", 1)] == counts[("cutlass", 10)] == 1
    assert counts[("loop", None)] >= 2
    assert budget.spent_ms <= 50

def test_a_call_as_long_as_the_heat_makes_its_probe_the_first_sample():
    """7 ms calls: the untimed call and the probe of the static choice are already 14 ms of GPU work.
    The probe is then the static choice's first sample, and round one starts with the next
    candidate, so one more candidate is timed within the same 35 ms."""
    ms = {("cutlass", 0): 7.0, ("torch", None): 7.4, ("cutlass", 2): 7.2, ("cutlass", 10): 11.0, ("loop", None): 6.3}
    timer = FakeTimer(ms)
    budget = Budget(bucket_ms=35, total_ms=2000)
    got = measure([(c, (lambda c=c: c)) for c in ms], budget, timer)
    assert [c for c, _ in timer.calls].count(("cutlass", 0)) == 1  # the probe, and no sample after it
    assert list(got) == [("cutlass", 0), ("torch", None), ("cutlass", 2)]  # a third sample of c0 would leave c2 out
    assert budget.spent_ms <= 35
    short = {c: 0.05 for c in ms}  # short calls: heat runs after the probe, which is no sample then
    timer = FakeTimer(short)
    measure([(c, (lambda c=c: c)) for c in short], Budget(bucket_ms=50, total_ms=2000), timer)
    assert timer.calls[1] == (("cutlass", 0), bucket_timing.MAX_REPS)  # round one samples it again


def test_the_bucket_is_never_overspent():
    for per_call in (0.01, 0.3, 2.0, 7.0, 12.0):
        ms = {c: per_call * (1 + 0.01 * i) for i, c in enumerate(MS)}
        budget = Budget(bucket_ms=50, total_ms=2000)
        measure([(c, (lambda c=c: c)) for c in ms], budget, FakeTimer(ms))
        assert budget.spent_ms <= 50 + per_call + bucket_timing.COVER_MS  # the probe is the only call past a cap

def test_host_stalls_count_against_the_bucket():
    """A candidate whose first call stalls the host (a library planning each new shape) uses up the
    bucket's wall time: no round starts after it."""
    first_calls = set()

    def run(choice):
        def call():
            if choice == ("loop", None) and choice not in first_calls:
                first_calls.add(choice)
                time.sleep(0.06)  # longer than the whole bucket
            return choice
        return call

    ms = {c: 0.05 for c in MS}
    timer = FakeTimer(ms)
    measure([(c, run(c)) for c in ms], Budget(bucket_ms=50, total_ms=2000), timer)
    sampled = [c for c, _ in timer.calls[1:]]
    assert sorted(sampled, key=str) == sorted(ms, key=str)  # round one, then nothing

def test_host_time_per_round_is_expected_again_and_charged():
    """Each round costs 8 ms of host time the GPU clock does not see (0.5 ms of GPU work): the rounds
    stop while the bucket's wall time still has room for one more, and the wall time is charged."""
    ms = {c: 0.1 for c in MS}
    overslept = []  # ms each sleep ran past what it asked for (a loaded host wakes late)

    def timer(fn, calls):
        asked, t = 0.008 / len(ms), time.perf_counter()
        time.sleep(asked)  # host time of one round, spread over its samples
        overslept.append(max(0.0, time.perf_counter() - t - asked) * 1e3)
        return ms[fn()]

    budget = Budget(bucket_ms=50, total_ms=2000)
    t0 = time.perf_counter()
    measure([(c, (lambda c=c: c)) for c in ms], budget, timer)
    wall = (time.perf_counter() - t0) * 1e3
    # no round started that the wall time could not afford: past 50 ms only by sleep jitter (2 ms, or
    # what the sleeps overran on a loaded host, which no plan can foresee)
    assert wall <= 50 + max(2.0, sum(overslept))
    assert budget.spent_ms >= wall - 0.5  # the wall time is what was charged


def test_every_sample_failing_leaves_the_probe_as_the_measurement():
    """Round one's samples all fail (the first run passed its probe, then failed): no crash, the
    probe's timing of the first run is the answer."""
    calls = []

    def timer(fn, n):
        calls.append(n)
        if len(calls) > 1:
            raise RuntimeError("launch failed")
        return MS[fn()]

    got = measure([(c, (lambda c=c: c)) for c in MS], Budget(bucket_ms=50, total_ms=2000), timer)
    assert got == {("cutlass", 0): MS[("cutlass", 0)]}
