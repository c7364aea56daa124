"""Measured grouped-GEMM choices (te_dist.backends.autotune): keys, selection, budget, switch, file.

The candidates' timings come from a fake timer (a table of ms per choice), so the selection
logic runs on CPU; GPU timing itself is covered by tests/kernels/test_autotune_gpu.py.
"""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

from te_dist.backends import autotune
from te_dist.backends.autotune import Autotuner, MissContext, Settings, bucket_key, bucket_rows
from te_dist.backends.loop_plans import LoopPlans
from fake_timing import MS, FakeTimer
from te_dist.backends.selection import Problem


def _p(**kw):
    base = dict(direction="fwd", device_type="cuda", capability=(9, 0), dtype=torch.bfloat16,
                out_dtype=torch.bfloat16, num_rows=8 * 256, k=4096, n=2048, num_groups=8, sizes_on_host=True)
    base.update(kw)
    return Problem(**base)


def _context(static=("cutlass", 0), configs=(0, 2, 10), built=(0, 2, 10)):
    return lambda: MissContext(static, lambda c: (lambda: c), True, True, tuple(configs), lambda c: c in built)


SIZES = (256,) * 8


def _tuner(tmp_path=None, timer=None, **settings):
    if tmp_path is not None:  # the file's lock and the kernel module's first import take wall time that
        settings.setdefault("bucket_ms", 1000.0)  # counts against the bucket: these tests are not about it
    s = Settings(persist=tmp_path is not None, directory=tmp_path, **settings)
    return Autotuner(s, timer=timer or FakeTimer(MS), identity=lambda i: ("Fake GPU", 132), file_tag="test")


@pytest.fixture(autouse=True)
def _tune_env(monkeypatch):
    monkeypatch.delenv(autotune.ENV, raising=False)


# ---------------------------------------------------------------------- keys


def test_rows_per_expert_round_up_to_a_power_of_two():
    assert [bucket_rows(r * 8, 8) for r in (0, 1, 2, 3, 200, 256, 257)] == [0, 1, 2, 4, 256, 256, 512]
    assert bucket_rows(5, 8) == 1  # a fraction of a row per expert is one row


def test_bucket_key_separates_what_changes_the_answer():
    base = bucket_key(_p(), SIZES)
    assert bucket_key(_p(num_rows=8 * 200), (200,) * 8) == base  # same bucket of rows per expert
    assert bucket_key(_p(num_rows=8 * 257), (257,) * 8) != base
    assert bucket_key(_p(k=4104), SIZES) != base  # K and N exactly
    assert bucket_key(_p(n=2056), SIZES) != base
    assert bucket_key(_p(num_groups=16, num_rows=16 * 256), (256,) * 16) != base
    assert bucket_key(_p(direction="dgrad"), SIZES) != base
    assert bucket_key(_p(out_dtype=torch.float32), SIZES) != base
    ragged = (512, 0, 256, 256, 256, 256, 256, 256)
    assert bucket_key(_p(), ragged) != base  # ragged vs even
    assert bucket_key(_p(sizes_on_host=False), None) != base  # the loop needs host sizes


def test_key_text_round_trips():
    for key in (bucket_key(_p(), SIZES), bucket_key(_p(direction="wgrad", out_dtype=torch.float32), None),
                bucket_key(_p(), (512, 0, 256, 256, 256, 256, 256, 256))):
        text = autotune.key_text(key)
        assert autotune.parse_key(text) == key
    with pytest.raises(ValueError):
        autotune.parse_key("fwd|notadtype|bfloat16|E8|K1|N1|m1|even|host")


# ---------------------------------------------------------------------- candidates and timing


def test_candidates_order_and_rules():
    got = autotune.candidates(_p(), ("cutlass", 0), cutlass_ok=True, torch_ok=True, group_sizes=SIZES,
                              built=lambda c: c != 10, configs=(0, 2, 10))
    assert got == [("cutlass", 0), ("torch", None), ("cutlass", 2), ("loop", None)]  # 10 not built: not timed
    no_host = autotune.candidates(_p(sizes_on_host=False), ("cutlass", 0), cutlass_ok=True, torch_ok=True,
                                  configs=(0, 2))
    assert ("loop", None) not in no_host  # the loop would read the offsets on the host
    fp32 = autotune.candidates(_p(dtype=torch.float32, out_dtype=torch.float32), ("loop", None), cutlass_ok=True,
                               torch_ok=True, group_sizes=SIZES, configs=(0,), built=lambda c: True)
    assert fp32 == [("loop", None)]  # nothing else can run it: nothing to measure


# ---------------------------------------------------------------------- the tuner


def test_first_call_measures_then_the_table_answers():
    timer = FakeTimer(MS)
    t = _tuner(timer=timer)
    assert t.choose(_p(), 0, SIZES, _context()) == ("cutlass", 2)  # the fastest
    measured = len(timer.calls)
    assert measured >= len(MS)
    assert t.choose(_p(num_rows=8 * 200), 0, (200,) * 8, _context()) == ("cutlass", 2)  # same bucket
    assert len(timer.calls) == measured  # no second measurement
    ranking = t.table_for(0).ranking[bucket_key(_p(), SIZES)]
    assert ranking[0] == ("cutlass", 2) and ranking[-1] == ("loop", None)


def test_loop_choice_is_skipped_while_capturing():
    fast_loop = {**MS, ("loop", None): 0.1}
    t = _tuner(timer=FakeTimer(fast_loop))
    assert t.choose(_p(), 0, SIZES, _context()) == ("loop", None)
    assert t.choose(_p(capturing=True), 0, SIZES, _context()) == ("cutlass", 2)  # next in the ranking


def test_no_measurement_while_capturing_or_deterministic(monkeypatch):
    timer = FakeTimer(MS)
    t = _tuner(timer=timer)
    assert t.choose(_p(capturing=True), 0, SIZES, _context()) is None
    t.settings.deterministic = True
    assert t.choose(_p(), 0, SIZES, _context()) is None
    t.settings.deterministic = False
    monkeypatch.setattr(autotune, "_deterministic_algorithms", lambda: True)
    assert t.choose(_p(), 0, SIZES, _context()) is None
    assert timer.calls == []


def test_switch_off_by_env_and_by_settings(monkeypatch):
    timer = FakeTimer(MS)
    monkeypatch.setenv(autotune.ENV, "0")
    t = _tuner(timer=timer)  # the switch is read when the process's tuner is made
    assert not t.enabled
    assert t.choose(_p(), 0, SIZES, _context()) is None
    monkeypatch.setenv(autotune.ENV, "1")
    t = _tuner(timer=timer)
    t.settings.enabled = False
    assert t.choose(_p(), 0, SIZES, _context()) is None
    assert timer.calls == []
    t.settings.enabled = True
    assert t.choose(_p(), 0, SIZES, _context()) == ("cutlass", 2)


def test_process_tuner_reads_the_switch_at_reset(monkeypatch):
    try:
        monkeypatch.setenv(autotune.ENV, "0")
        assert not autotune.reset().enabled
        monkeypatch.delenv(autotune.ENV)
        assert autotune.reset().enabled
    finally:
        autotune.reset()


def test_configure_validates_and_reset_restores(monkeypatch):
    try:
        with pytest.raises(TypeError, match="enabled must be a bool"):
            autotune.configure(enabled="no")
        with pytest.raises(ValueError, match="total_ms"):
            autotune.configure(total_ms=-1)
        s = autotune.configure(enabled=False, total_ms=10)
        assert not s.enabled and autotune.tuner().budget.total_ms == 10
    finally:
        autotune.reset()
    assert autotune.tuner().settings.enabled


def test_budget_spent_falls_back_to_the_static_table():
    slow = {c: 10.0 for c in MS}
    timer = FakeTimer(slow)
    t = _tuner(timer=timer, bucket_ms=50, total_ms=60)
    first = t.choose(_p(), 0, SIZES, _context())
    assert first is not None
    n = 0
    while t.budget.left() > 0 and n < 10:  # new buckets until the run's budget is gone
        n += 1
        t.choose(_p(k=4096 + 8 * n), 0, SIZES, _context())
    assert t.budget.left() == 0 and t.budget.spent_ms <= 60 + 20
    before = len(timer.calls)
    assert t.choose(_p(k=8192), 0, SIZES, _context()) is None  # a new bucket: static table, no timing
    assert len(timer.calls) == before


def test_fewer_than_two_candidates_measures_nothing():
    timer = FakeTimer(MS)
    t = _tuner(timer=timer)
    ctx = lambda: MissContext(("loop", None), lambda c: (lambda: c), False, False)  # noqa: E731
    built = []
    ctx = lambda: built.append(1) or MissContext(("loop", None), lambda c: (lambda: c), False, False)  # noqa: E731
    assert t.choose(_p(sizes_on_host=False), 0, None, ctx) is None
    assert t.choose(_p(sizes_on_host=False), 0, None, ctx) is None
    assert timer.calls == [] and len(built) == 1  # the second call did not look for candidates again
    assert t.export() == {"Fake GPU|sm132": {}}  # and nothing of it is written or sent


# ---------------------------------------------------------------------- the loop's first call

ZIPF8 = (700, 420, 300, 230, 180, 150, 60, 8)  # 8 distinct sizes: 8 x 2 ms of plans > a quarter of 50 ms


def _recording_context(order, plan_sleep_s=0.0):
    """Runners that log each call; the loop's first call sleeps ``plan_sleep_s`` (its library plans)."""

    def run(choice):
        def call():
            if choice == ("loop", None) and ("loop", None) not in order and plan_sleep_s:
                time.sleep(plan_sleep_s)
            order.append(choice)
            return choice
        return call

    return lambda: MissContext(("cutlass", 0), run, True, True, (0, 2, 10), lambda c: True)


def test_loop_is_timed_only_where_its_first_call_fits_the_bucket():
    timer = FakeTimer(MS)
    t = _tuner(timer=timer)
    t.choose(_p(), 0, ZIPF8, _context())
    assert ("loop", None) not in {c for c, _ in timer.calls}  # 8 new shapes x 2 ms > 12.5 ms
    assert t.choose(_p(), 0, SIZES, _context()) is not None  # even: one new shape
    assert ("loop", None) in {c for c, _ in timer.calls}


def test_loop_plans_are_made_before_the_timing_and_remembered():
    order = []
    t = _tuner(timer=FakeTimer(MS))
    t.choose(_p(), 0, SIZES, _recording_context(order))
    assert order[0] == ("cutlass", 0) or order.index(("loop", None)) < order.index(("torch", None))
    assert t.loop_plans.seen == {("fwd", torch.bfloat16, 4096, 2048, 256)}
    # the same expert sizes in another bucket (16 experts) are planned already: nothing new to predict
    sizes16 = ZIPF8 + ZIPF8
    assert t.loop_plans.new_shapes(_p(num_groups=16, num_rows=sum(sizes16)), sizes16) == {
        ("fwd", torch.bfloat16, 4096, 2048, m) for m in ZIPF8}
    t.loop_plans.seen |= t.loop_plans.new_shapes(_p(), ZIPF8)
    assert t.loop_plans.new_shapes(_p(num_groups=16, num_rows=sum(sizes16)), sizes16) == set()


def test_a_slow_loop_plan_is_charged_to_the_bucket():
    order = []
    t = _tuner(timer=FakeTimer(MS))
    t.choose(_p(), 0, SIZES, _recording_context(order, plan_sleep_s=0.06))  # past the 50 ms bucket
    assert t.budget.spent_ms >= 60
    assert t.last_miss_ms >= 60
    ranking = t.table_for(0).ranking[bucket_key(_p(), SIZES)]
    assert ranking == (("cutlass", 0),)  # nothing was left to time the others: the probe of the first


def test_loop_plan_estimate_follows_observations_within_bounds():
    plans = LoopPlans()
    new8 = {("fwd", torch.bfloat16, 1, 1, m) for m in range(1, 9)}
    assert plans.ms_per_new["fwd"] == LoopPlans.PRIOR_MS["fwd"] and not plans.fits(new8, 50.0)
    plans.observe(new8, 8 * 0.5)
    assert plans.ms_per_new["fwd"] == 0.5 and plans.fits(new8, 50.0)
    plans.observe({("fwd", torch.bfloat16, 1, 1, 99)}, 100.0)  # one new shape: no update
    assert plans.ms_per_new["fwd"] == 0.5
    plans.observe({("dgrad", torch.bfloat16, 1, 1, m) for m in (1, 2)}, 200.0)  # a one-off stall
    assert plans.ms_per_new["dgrad"] == LoopPlans.CEIL_MS
    plans.observe({("wgrad", torch.bfloat16, 1, 1, m) for m in (1, 2)}, 0.0)
    assert plans.ms_per_new["wgrad"] == LoopPlans.FLOOR_MS
    assert plans.ms_per_new["fwd"] == 0.5  # each direction keeps its own estimate
    assert len(plans.seen) == 8 + 1 + 2 + 2
    assert plans.estimate(set()) == 0.0


def test_a_slow_first_call_in_one_direction_leaves_the_loop_a_candidate_in_another():
    """fwd's plans stalled 3 ms per new shape (kernels loaded per row count); wgrad's planning of 16
    new shapes is still predicted to fit a quarter of the bucket (its own prior)."""
    plans = LoopPlans()
    plans.observe({("fwd", torch.bfloat16, 1, 1, m) for m in range(1, 17)}, 16 * 3.0)
    wgrad16 = {("wgrad", torch.bfloat16, 1, 1, m) for m in range(1, 17)}
    fwd16 = {("fwd", torch.bfloat16, 1, 1, m) for m in range(17, 33)}
    assert plans.fits(wgrad16, 50.0) and not plans.fits(fwd16, 50.0)


# ---------------------------------------------------------------------- persistence


def test_choices_persist_and_reload(tmp_path):
    timer = FakeTimer(MS)
    assert _tuner(tmp_path, timer).choose(_p(), 0, SIZES, _context()) == ("cutlass", 2)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and files[0].name.startswith("Fake_GPU-sm132-")
    data = json.loads(files[0].read_text())
    entry = data["entries"][autotune.key_text(bucket_key(_p(), SIZES))]
    assert entry["ranking"][0] == "cutlass:2" and entry["ms"]["torch"] == MS[("torch", None)]
    fresh_timer = FakeTimer(MS)
    again = _tuner(tmp_path, fresh_timer)  # a new process, or another rank of the node
    assert again.choose(_p(), 0, SIZES, _context()) == ("cutlass", 2)
    assert fresh_timer.calls == []


def test_the_file_text_is_the_table_and_follows_every_change():
    """The file's entries are encoded once per entry and reused: whatever replaces a ranking or its
    ms (a new measurement, a reload, an agreed table), the text written next says the same as the table."""
    table = autotune._Table(None)
    keys = [bucket_key(_p(k=k), SIZES) for k in (1024, 2048, 4096)]
    for i, key in enumerate(keys):
        table.put(key, {("cutlass", 0): 1.0 + i, ("torch", None): 2.0})
    table.ranking[bucket_key(_p(k=8192), SIZES)] = ()  # nothing to choose: not written
    assert json.loads(table.entries_json()) == table.to_entries() and len(table.to_entries()) == 3
    table.put(keys[0], {("cutlass", 0): 5.0, ("torch", None): 2.0})  # re-measured: torch now first
    table.ms[keys[1]] = {"cutlass:0": 9.0}  # replaced from outside (a reload, an agreed table)
    table.ranking[keys[2]] = (("torch", None),)
    entries = json.loads(table.entries_json())
    assert entries == table.to_entries()
    assert entries[autotune.key_text(keys[0])]["ranking"] == ["torch", "cutlass:0"]
    assert entries[autotune.key_text(keys[1])]["ms"] == {"cutlass:0": 9.0}


def test_time_after_the_measurement_is_reserved_in_the_next_bucket(tmp_path, monkeypatch):
    """Ranking and file write come after the timing: their wall time (here a slow write) is taken
    from the measurement's end, and the next misses start with that much of their bucket spent, also
    after fast writes (a write that stalled once is expected to stall again)."""
    from cutlass_kernels import cache

    real_write = cache.write_atomic
    delay = [0.03]
    monkeypatch.setattr(cache, "write_atomic", lambda path, data: time.sleep(delay[0]) or real_write(path, data))
    seen = []
    real_measure = autotune.measure
    monkeypatch.setattr(autotune, "measure", lambda runs, budget, timer, elapsed, **kw: seen.append(elapsed)
                        or real_measure(runs, budget, timer, elapsed, **kw))
    t = _tuner(tmp_path)
    t.choose(_p(), 0, SIZES, _context())
    reserve = t.save_ms
    assert 30 <= reserve < 1000
    delay[0] = 0.0
    t.choose(_p(k=1024), 0, SIZES, _context())
    t.choose(_p(k=2048), 0, SIZES, _context())
    assert len(seen) == 3 and seen[1] >= reserve and seen[2] >= reserve
    assert t.save_ms == reserve  # the fast writes did not lower it


def test_file_is_keyed_by_device_and_versions(tmp_path):
    _tuner(tmp_path).choose(_p(), 0, SIZES, _context())
    other = Autotuner(Settings(directory=tmp_path), timer=FakeTimer(MS), identity=lambda i: ("Fake GPU", 114),
                      file_tag="test")
    other.choose(_p(), 0, SIZES, _context())
    newer = Autotuner(Settings(directory=tmp_path), timer=FakeTimer(MS), identity=lambda i: ("Fake GPU", 132),
                      file_tag="torch 9.9")
    newer.choose(_p(), 0, SIZES, _context())
    assert len(list(tmp_path.glob("*.json"))) == 3


@pytest.mark.parametrize("content", ["{\"version\": 1, \"entries\": {\"fwd|bf", "not json", "[]",
                                     "{\"version\": 99, \"entries\": {}}",
                                     "{\"version\": 1, \"entries\": {\"bogus\": {\"ranking\": [\"torch\"]}}}"])
def test_torn_or_foreign_file_is_ignored_with_a_warning(tmp_path, content):
    _tuner(tmp_path).choose(_p(k=8192), 0, SIZES, _context())  # create the file, then tear it
    path = next(tmp_path.glob("*.json"))
    path.write_text(content)
    timer = FakeTimer(MS)
    t = _tuner(tmp_path, timer)
    with pytest.warns(UserWarning, match="ignoring the unreadable tuning file"):
        assert t.choose(_p(), 0, SIZES, _context()) == ("cutlass", 2)
    assert timer.calls  # measured afresh
    data = json.loads(path.read_text())  # and rewritten whole
    assert autotune.key_text(bucket_key(_p(), SIZES)) in data["entries"]


def test_write_is_atomic_no_temp_files_left(tmp_path):
    from cutlass_kernels import cache

    target = tmp_path / "t.json"
    cache.write_atomic(target, b"one")
    cache.write_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    from cutlass_kernels import cache

    target = tmp_path / "t.json"
    cache.write_atomic(target, b"old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(cache.os, "replace", broken_replace)
    with pytest.raises(OSError):
        cache.write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_unwritable_directory_keeps_choices_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    t = _tuner(blocker / "sub")  # a directory below a file cannot be created
    with pytest.warns(UserWarning, match="choices stay in memory"):
        assert t.choose(_p(), 0, SIZES, _context()) == ("cutlass", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not per call
        assert t.choose(_p(k=8192), 0, SIZES, _context()) == ("cutlass", 2)


def test_another_rank_measuring_means_static_now_and_its_result_later(tmp_path):
    from cutlass_kernels import cache

    writer = _tuner(tmp_path)
    writer.choose(_p(k=8192), 0, SIZES, _context())  # the file exists
    path = next(tmp_path.glob("*.json"))
    timer = FakeTimer(MS)
    reader = _tuner(tmp_path, timer)
    with cache.try_locked(path) as held:  # "another rank" holds the lock while it measures
        assert held
        assert reader.choose(_p(), 0, SIZES, _context()) is None
        writer.table_for(0).put(bucket_key(_p(), SIZES), {("torch", None): 0.5, ("cutlass", 0): 1.0})
        writer._save(writer.table_for(0), cache)
    assert reader.choose(_p(), 0, SIZES, _context()) == ("torch", None)  # read, not measured
    assert timer.calls == []


# ---------------------------------------------------------------------- agreement (single process)


def test_adopt_replaces_entries_and_agreed_tables_answer_in_deterministic_mode():
    a, b = _tuner(timer=FakeTimer(MS)), _tuner(timer=FakeTimer({**MS, ("torch", None): 0.1}))
    assert a.choose(_p(), 0, SIZES, _context()) == ("cutlass", 2)
    assert b.choose(_p(), 0, SIZES, _context()) == ("torch", None)
    b.settings.deterministic = True
    assert b.choose(_p(), 0, SIZES, _context()) is None  # not agreed yet: static
    b.adopt(json.loads(json.dumps(a.export())))
    assert b.choose(_p(), 0, SIZES, _context()) == ("cutlass", 2)


def test_agree_without_a_process_group_is_local(monkeypatch):
    from te_dist.distributed import agree_tuned_choices

    t = autotune.reset(_tuner())
    try:
        t.choose(_p(), 0, SIZES, _context())
        assert agree_tuned_choices() == 1
        assert t.agreed and t.settings.deterministic
        assert t.choose(_p(), 0, SIZES, _context()) == ("cutlass", 2)
        assert t.choose(_p(k=8192), 0, SIZES, _context()) is None  # frozen: nothing new is measured
    finally:
        autotune.reset()


# ---------------------------------------------------------------------- the CLI's shapes file


def test_shapes_file_json_and_csv(tmp_path):
    from te_dist import tune

    j = tmp_path / "s.json"
    j.write_text(json.dumps({"shapes": [{"direction": "fwd", "E": 8, "K": 2880, "N": 5760, "rows_per_expert": 64,
                                         "ragged": True}, {"direction": "all", "E": 4, "K": 16, "N": 32, "rows": 8}]}))
    got = tune.read_shapes(j)
    assert got[0] == tune.Shape("fwd", 8, 2880, 5760, 64, True)
    assert [s.direction for s in got[1:]] == ["fwd", "dgrad", "wgrad"] and not got[1].ragged
    c = tmp_path / "s.csv"
    c.write_text("# comment\ndirection,E,K,N,rows_per_expert,ragged\nwgrad,32,7168,4096,256,false\n"
                 "dgrad,16,2048,1536,0,yes  # empty\n")
    assert tune.read_shapes(c) == [tune.Shape("wgrad", 32, 7168, 4096, 256, False),
                                   tune.Shape("dgrad", 16, 2048, 1536, 0, True)]
    c.write_text("direction,E,K,N,rows_per_expert\nsideways,8,1,1,1\n")
    with pytest.raises(ValueError, match="row 1: direction must be one of"):
        tune.read_shapes(c)
    c.write_text("direction,E,K,rows_per_expert\nfwd,8,1,1\n")
    with pytest.raises(ValueError, match="missing 'N'"):
        tune.read_shapes(c)


def test_zipf_splits_are_skewed_with_empty_experts():
    from te_dist.tune import zipf_splits

    for E, m in ((8, 512), (32, 128), (64, 7), (4, 16)):
        sizes = zipf_splits(E, m)
        assert len(sizes) == E and sum(sizes) == E * m
        assert sizes.count(0) >= max(1, E // 8)
        assert max(sizes) > 2 * m  # skewed
    assert zipf_splits(32, 128) == zipf_splits(32, 128)  # seeded


def test_tune_cli_without_cuda_says_so(tmp_path, capsys):
    """``te-dist tune`` and its alias ``python -m cutlass_kernels tune`` (a process of its own) both
    say why nothing was tuned; a bad shapes file is a usage error naming the row."""
    import subprocess
    import sys

    from te_dist.cli import main

    if torch.cuda.is_available():
        pytest.skip("the message is for CPU-only hosts")
    f = tmp_path / "s.csv"
    f.write_text("direction,E,K,N,rows_per_expert,ragged\nfwd,8,16,16,8,false\n")
    assert main(["tune", "--shapes", str(f)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    alias = subprocess.run([sys.executable, "-m", "cutlass_kernels", "tune", "--shapes", str(f)], capture_output=True,
                           text=True, timeout=120)
    assert alias.returncode == 2 and "no CUDA device" in alias.stderr, alias.stderr
    f.write_text("direction,E,K,N,rows_per_expert\nsideways,8,1,1,1\n")
    assert main(["tune", "--shapes", str(f)]) == 2
    assert "row 1: direction must be one of" in capsys.readouterr().err
    assert main(["tune", "--shapes", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err


def test_ragged_answer_is_per_tuple():
    """The one-entry memo of the ragged check answers by tuple identity, never for another tuple."""
    ragged, even = (512, 0, 256), (256, 256, 256)
    assert autotune._ragged(ragged) and autotune._ragged(ragged)  # asked again: the memo
    assert not autotune._ragged(even) and not autotune._ragged(tuple(even))
    assert autotune._ragged(list(ragged)) and not autotune._ragged(None)
    assert bucket_key(_p(num_groups=3, num_rows=768), ragged) != bucket_key(_p(num_groups=3, num_rows=768), even)


def test_a_tile_is_a_candidate_only_when_built_and_its_library_opens():
    """Opening a tile's library happens before the timing (kernels._built_and_open), never in a
    timed call, and a library that does not open is no candidate."""
    from types import SimpleNamespace

    from te_dist import kernels

    opened = []

    def load(direction, config, out_f32):
        if config == 3:
            raise OSError("undefined symbol")
        opened.append((direction, config, out_f32))

    ck = SimpleNamespace(build=SimpleNamespace(is_built=lambda d, c, f: c != 2), load=load)
    assert kernels._built_and_open(ck, "fwd", 0, False)
    assert not kernels._built_and_open(ck, "fwd", 2, False)  # not built: not opened either
    assert not kernels._built_and_open(ck, "wgrad", 3, True)
    assert opened == [("fwd", 0, False)]
