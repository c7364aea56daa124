"""Measured grouped-GEMM choices (te_dist.gemm.measure): keys, timing, budget, switch, file, agreement.

The candidates' timings come from a fake timer (ms per choice), so everything runs on CPU; the
decision that reads the entries is tests/kernels/test_decide.py's.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from fake_timing import MS, FakeTimer
from te_dist import settings
from te_dist.gemm import decide, measure
from te_dist.gemm.decide import Problem
from te_dist.gemm.measure import Tuner, TunerSettings, bucket_key, bucket_rows

SIZES = (256,) * 8


def _p(**kw):
    base = dict(direction="fwd", device_type="cuda", capability=(9, 0), dtype=torch.bfloat16,
                out_dtype=torch.bfloat16, num_rows=8 * 256, k=4096, n=2048, num_groups=8, sizes_on_host=True)
    base.update(kw)
    return Problem(**base)


def _runs(choices=tuple(MS)):
    return lambda: [(c, lambda c=c: c) for c in choices]


def _tuner(tmp_path=None, timer=None, **settings):
    s = TunerSettings(persist=tmp_path is not None, directory=tmp_path, **{"bucket_ms": 1000.0, **settings})
    return Tuner(s, timer=timer or FakeTimer(MS), identity=lambda i: ("Fake GPU", 132), file_tag="test")


def _pick(t, p=None, sizes=SIZES, runs=None):
    p = p or _p()
    ms = t.entry(p, 0, sizes, runs or _runs())
    return None if ms is None else decide.pick_measured(ms, p)


# ---------------------------------------------------------------------- keys


def test_rows_per_expert_round_up_to_a_power_of_two():
    assert [bucket_rows(r * 8, 8) for r in (0, 1, 2, 3, 200, 256, 257)] == [0, 1, 2, 4, 256, 256, 512]


def test_bucket_key_separates_what_changes_the_answer():
    base = bucket_key(_p(), SIZES)
    assert bucket_key(_p(num_rows=8 * 200), (200,) * 8) == base
    for other in (bucket_key(_p(num_rows=8 * 257), (257,) * 8), bucket_key(_p(k=4104), SIZES),
                  bucket_key(_p(n=2056), SIZES), bucket_key(_p(direction="dgrad"), SIZES),
                  bucket_key(_p(out_dtype=torch.float32), SIZES), bucket_key(_p(), (512, 0) + (256,) * 6),
                  bucket_key(_p(sizes_on_host=False), None), bucket_key(_p(epilogue=True), SIZES)):
        assert other != base


def test_key_text_round_trips():
    for key in (bucket_key(_p(), SIZES), bucket_key(_p(direction="wgrad", out_dtype=torch.float32), None),
                bucket_key(_p(epilogue=True), (512, 0) + (256,) * 6)):
        assert measure.parse_key(measure.key_text(key)) == key
    with pytest.raises(ValueError):
        measure.parse_key("fwd|notadtype|bfloat16|E8|K1|N1|m1|even|host|plain")
    assert measure.parse_choice("cutlass:10") == ("cutlass", 10) and measure.choice_name(("torch", None)) == "torch"


# ---------------------------------------------------------------------- timing


def test_time_runs_interleaves_rounds_and_takes_the_median():
    order = []
    ms = {"a": [1.0, 5.0, 1.1, 1.2, 1.0, 1.3], "b": [2.0, 2.1, 0.5, 2.2, 2.0, 2.0]}

    def timer(fn, calls):
        name = fn()
        order.append(name)
        return ms[name].pop(0)

    got = measure.time_runs([("a", lambda: "a"), ("b", lambda: "b")], measure._CallClock(timer), 1000.0)
    assert got == {"a": 1.1, "b": 2.0}  # a flattering or a stalled sample does not decide
    assert order[:5] == ["a", "a", "b", "b", "a"]  # probe, then rotated rounds


def test_time_runs_leaves_out_a_failing_candidate_and_stops_at_the_budget():
    def boom():
        raise RuntimeError("unsupported shape")

    timer = FakeTimer({"a": 1.0, "b": 2.0})
    got = measure.time_runs([("a", lambda: "a"), ("x", boom), ("b", lambda: "b")], measure._CallClock(timer), 1000.0)
    assert set(got) == {"a", "b"}
    slow = FakeTimer({"a": 10.0, "b": 10.0})
    assert measure.time_runs([("a", lambda: "a"), ("b", lambda: "b")], measure._CallClock(slow), 15.0) == {"a": 10.0}
    assert measure.time_runs([("a", lambda: "a")], measure._CallClock(slow), 0.0) == {}


# ---------------------------------------------------------------------- the tuner


def test_first_call_measures_then_the_entry_answers():
    timer = FakeTimer(MS)
    t = _tuner(timer=timer)
    assert _pick(t) == ("cutlass", 2)  # 0.6 ms against torch's 0.8: past the margin
    measured = len(timer.calls)
    assert measured >= len(MS)
    assert _pick(t, _p(num_rows=8 * 200), (200,) * 8) == ("cutlass", 2)  # same bucket
    assert len(timer.calls) == measured


def test_a_win_inside_the_margin_keeps_torch():
    t = _tuner(timer=FakeTimer({**MS, ("cutlass", 2): 0.79}))
    assert _pick(t) == ("torch", None)


def test_no_measurement_while_capturing_or_deterministic(monkeypatch):
    timer = FakeTimer(MS)
    t = _tuner(timer=timer)
    assert _pick(t, _p(capturing=True)) is None
    t.settings.deterministic = True
    assert _pick(t) is None
    t.settings.deterministic = False
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert _pick(t) is None
    assert timer.calls == []


def test_the_switch_is_the_settings_tune_field():
    """Every tuner follows te_dist.settings.tune, whether made before or after it changed."""
    t = _tuner()
    with settings.override(tune=False):
        assert not t.enabled and not _tuner().enabled and not measure.tuner().enabled
        with settings.override(tune=True):
            assert t.enabled and measure.tuner().enabled
        assert not t.enabled
    assert t.enabled == settings.current().tune


def test_configure_validates_everything_first_and_enabled_sets_the_process_value():
    tune = settings.current().tune
    with pytest.raises(TypeError, match="enabled must be a bool"):
        measure.configure(enabled="no", total_ms=10)
    with pytest.raises(ValueError, match="total_ms"):
        measure.configure(enabled=not tune, total_ms=-1)
    assert measure.tuner().settings.total_ms == TunerSettings().total_ms and settings.current().tune == tune
    try:
        s = measure.configure(enabled=False, total_ms=10)
        assert s.total_ms == 10 and not measure.tuner().enabled and not settings.current().tune
        assert settings.source("tune") == "te_dist.settings.tune=False"
        with settings.override(tune=True):  # an override wins over the process value while it lasts
            assert measure.tuner().enabled
        assert not measure.tuner().enabled
    finally:
        measure.reset()
        measure.configure(enabled=tune)
    assert measure.tuner().settings.total_ms == TunerSettings().total_ms and measure.tuner().enabled == tune


def test_budget_spent_leaves_new_buckets_to_the_static_rule(monkeypatch):
    timer = FakeTimer(MS)
    t = _tuner(timer=timer, total_ms=5.0)
    clock = iter(range(0, 10 ** 6, 3))  # every perf_counter read is 3 ms later
    monkeypatch.setattr(measure, "perf_counter", lambda: next(clock) / 1e3)
    _pick(t)
    assert t.spent_ms >= 5.0
    before = len(timer.calls)
    assert _pick(t, _p(k=8192)) is None and len(timer.calls) == before


def test_one_candidate_measures_nothing_and_is_remembered():
    built = []
    t = _tuner()
    runs = lambda: built.append(1) or [(("torch", None), lambda: ("torch", None))]  # noqa: E731
    assert _pick(t, runs=runs) is None and _pick(t, runs=runs) is None
    assert len(built) == 1  # the second call did not look for candidates again
    assert t.export() == {"Fake GPU|sm132": {}}


# ---------------------------------------------------------------------- persistence


def test_entries_persist_and_reload(tmp_path):
    assert _pick(_tuner(tmp_path)) == ("cutlass", 2)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and files[0].name.startswith("Fake_GPU-sm132-")
    entry = json.loads(files[0].read_text())["entries"][measure.key_text(bucket_key(_p(), SIZES))]
    assert entry["torch"] == MS[("torch", None)] and entry["cutlass:2"] == MS[("cutlass", 2)]
    fresh = FakeTimer(MS)
    assert _pick(_tuner(tmp_path, fresh)) == ("cutlass", 2)  # a new process, or another rank of the node
    assert fresh.calls == []


def test_file_is_keyed_by_device_and_versions(tmp_path):
    _pick(_tuner(tmp_path))
    for ident, tag in ((("Fake GPU", 114), "test"), (("Fake GPU", 132), "torch 9.9")):
        _pick(Tuner(TunerSettings(directory=tmp_path), timer=FakeTimer(MS), identity=lambda i, ident=ident: ident,
                    file_tag=tag))
    assert len(list(tmp_path.glob("*.json"))) == 3


@pytest.mark.parametrize("content", ["{\"version\": 2, \"entries\": {\"fwd|bf", "not json", "[]",
                                     "{\"version\": 1, \"entries\": {}}",
                                     "{\"version\": 2, \"entries\": {\"bogus\": {\"torch\": 1.0}}}"])
def test_torn_or_foreign_file_is_ignored_with_a_warning(tmp_path, content):
    _pick(_tuner(tmp_path), _p(k=8192))
    path = next(tmp_path.glob("*.json"))
    path.write_text(content)
    timer = FakeTimer(MS)
    with pytest.warns(UserWarning, match="ignoring the unreadable tuning file"):
        assert _pick(_tuner(tmp_path, timer)) == ("cutlass", 2)
    assert timer.calls  # measured afresh, and the file rewritten whole
    assert measure.key_text(bucket_key(_p(), SIZES)) in json.loads(path.read_text())["entries"]


def test_unwritable_directory_keeps_entries_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    t = _tuner(blocker / "sub")
    with pytest.warns(UserWarning, match="choices stay in memory"):
        assert _pick(t) == ("cutlass", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not per call
        assert _pick(t, _p(k=8192)) == ("cutlass", 2)


def test_another_rank_measuring_means_static_now_and_its_result_later(tmp_path):
    from cutlass_kernels import cache

    writer = _tuner(tmp_path)
    _pick(writer, _p(k=8192))
    path = next(tmp_path.glob("*.json"))
    timer = FakeTimer(MS)
    reader = _tuner(tmp_path, timer)
    with cache.try_locked(path) as held:  # "another rank" holds the lock while it measures
        assert held
        assert _pick(reader) is None
        writer.table_for(0).ms[bucket_key(_p(), SIZES)] = {("torch", None): 0.5, ("cutlass", 0): 1.0}
        writer._save(writer.table_for(0), cache)
    assert _pick(reader) == ("torch", None)  # read, not measured
    assert timer.calls == []


# ---------------------------------------------------------------------- agreement (single process)


def test_adopt_replaces_entries_and_agreed_tables_answer_in_deterministic_mode():
    a, b = _tuner(), _tuner(timer=FakeTimer({**MS, ("torch", None): 0.1}))
    assert _pick(a) == ("cutlass", 2) and _pick(b) == ("torch", None)
    b.settings.deterministic = True
    assert b.entry(_p(), 0, SIZES, _runs()) is None  # not agreed yet: the static rule
    b.adopt(json.loads(json.dumps(a.export())))
    assert _pick(b) == ("cutlass", 2)


def test_agree_without_a_process_group_is_local():
    from te_dist.distributed import agree_tuned_choices

    t = measure.reset(_tuner())
    try:
        _pick(t)
        assert agree_tuned_choices() == 1
        assert t.agreed and t.settings.deterministic
        assert _pick(t) == ("cutlass", 2)
        assert _pick(t, _p(k=8192)) is None  # frozen: nothing new is measured
    finally:
        measure.reset()


# ---------------------------------------------------------------------- the tune CLI's shapes file


def test_shapes_file_json_and_csv(tmp_path):
    from te_dist import tune

    j = tmp_path / "s.json"
    j.write_text(json.dumps({"shapes": [{"direction": "fwd", "E": 8, "K": 2880, "N": 5760, "rows_per_expert": 64,
                                         "ragged": True}, {"direction": "all", "E": 4, "K": 16, "N": 32, "rows": 8}]}))
    got = tune.read_shapes(j)
    assert got[0] == tune.Shape("fwd", 8, 2880, 5760, 64, True)
    assert [s.direction for s in got[1:]] == ["fwd", "dgrad", "wgrad"] and not got[1].ragged
    c = tmp_path / "s.csv"
    c.write_text("direction,E,K,N,rows_per_expert\nsideways,8,1,1,1\n")
    with pytest.raises(ValueError, match="row 1: direction must be one of"):
        tune.read_shapes(c)


def test_zipf_splits_are_skewed_with_empty_experts():
    from te_dist.tune import zipf_splits

    for E, m in ((8, 512), (32, 128), (64, 7), (4, 16)):
        sizes = zipf_splits(E, m)
        assert len(sizes) == E and sum(sizes) == E * m
        assert sizes.count(0) >= max(1, E // 8) and max(sizes) > 2 * m
    assert zipf_splits(32, 128) == zipf_splits(32, 128)


def test_tune_cli_without_cuda_says_so(tmp_path, capsys):
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
    assert main(["tune", "--shapes", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err
