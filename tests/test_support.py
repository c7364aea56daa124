"""Support predicates: device-keyed answers, caching, thread safety (capability lookup injected)."""

import copy
import pickle
import threading

import pytest
import torch

from te_dist import recipe as R
from te_dist import support as S

PREDICATES = [S.is_module_grouped_tensor_supported, S.is_op_fuser_grouped_tensor_supported]

# Two fake GPUs of different capability: cuda:0 is Hopper (9.0), cuda:1 is Blackwell (10.0).
FAKE_CAPS = {0: (9, 0), 1: (10, 0), 2: (8, 0)}


@pytest.fixture
def fake_gpus():
    looked_up = []

    def lookup(device):
        looked_up.append(device)
        return FAKE_CAPS[device.index] if device.type == "cuda" else None

    with S.set_capability_lookup(lookup), S.set_fp8_kernels_lookup(lambda: True):
        yield looked_up


HOPPER, BLACKWELL, AMPERE = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 2)
CPU = torch.device("cpu")


@pytest.mark.parametrize("pred", PREDICATES)
def test_answers_differ_by_device_capability(fake_gpus, pred):
    mx = R.MXFP8BlockScaling()
    assert pred(mx, torch.bfloat16, split_alignment=32, device=BLACKWELL) is True
    assert pred(mx, torch.bfloat16, split_alignment=32, device=HOPPER) is False
    # and the Hopper answer was computed for Hopper, not copied from the Blackwell entry
    assert pred.cache_info().currsize == 2
    assert pred(None, torch.bfloat16, device=HOPPER) is True
    assert pred(None, torch.bfloat16, device=AMPERE) is False
    assert pred(mx, torch.bfloat16, split_alignment=32, device=CPU) is True


def test_rule_table(fake_gpus):
    f = S.is_module_grouped_tensor_supported
    nv = R.NVFP4BlockScaling()
    assert f(nv, torch.bfloat16, split_alignment=16, device=BLACKWELL) is True
    assert f(nv, torch.bfloat16, split_alignment=8, device=BLACKWELL) is False
    nv.disable_2d_quantization = True  # the setting the NVFP4 rule reads
    assert f(nv, torch.bfloat16, split_alignment=16, device=BLACKWELL) is False
    assert f(nv, torch.bfloat16, split_alignment=32, device=BLACKWELL) is True
    cur = R.Float8CurrentScaling()
    assert f(cur, torch.bfloat16, split_alignment=16, device=HOPPER) is True
    assert f(cur, torch.bfloat16, split_alignment=None, device=HOPPER) is False  # unknown alignment
    cur.fp8_format = R.Format.E5M2
    assert f(cur, torch.bfloat16, split_alignment=16, device=HOPPER) is False
    block = R.Float8BlockScaling()
    assert f(block, torch.bfloat16, split_alignment=128, device=HOPPER) is True
    assert f(block, torch.bfloat16, split_alignment=64, device=HOPPER) is False  # wgrad's 1x128 token blocks
    assert f(block, torch.bfloat16, split_alignment=128, device=BLACKWELL) is False  # kernels are sm_90a
    block.w_block_scaling_dim = 1  # 1x128 weight blocks: no kernel for them
    assert f(block, torch.bfloat16, split_alignment=128, device=HOPPER) is False
    assert f(None, torch.float16, device=HOPPER) is False
    # the op fuser additionally needs bf16 activations on CUDA
    d = R.DelayedScaling()
    assert f(d, torch.float16, split_alignment=16, device=HOPPER) is True
    assert S.is_op_fuser_grouped_tensor_supported(d, torch.float16, split_alignment=16, device=HOPPER) is False


@pytest.mark.parametrize("pred", PREDICATES)
def test_cache_hits_and_distinct_entries_per_device(fake_gpus, pred):
    r = R.DelayedScaling()
    pred.cache_clear()
    for _ in range(5):
        pred(r, torch.bfloat16, split_alignment=16, device=HOPPER)
    info = pred.cache_info()
    assert (info.hits, info.misses, info.currsize) == (4, 1, 1)
    assert len(fake_gpus) == 1  # capability looked up once
    pred(r, torch.bfloat16, split_alignment=16, device=BLACKWELL)
    assert pred.cache_info().currsize == 2
    assert pred.cache_info().misses == 2


def test_key_holds_only_settings_the_check_reads(fake_gpus):
    f = S.is_module_grouped_tensor_supported
    f.cache_clear()
    a = R.DelayedScaling(amax_history_len=16)
    b = R.DelayedScaling(amax_history_len=32, margin=3)  # differs only in settings the rule ignores
    f(a, torch.bfloat16, split_alignment=16, device=HOPPER)
    f(b, torch.bfloat16, split_alignment=16, device=HOPPER)
    assert f.cache_info().currsize == 1 and f.cache_info().hits == 1
    # None recipe does not read the alignment: one entry for any alignment
    f(None, torch.bfloat16, split_alignment=8, device=HOPPER)
    f(None, torch.bfloat16, split_alignment=64, device=HOPPER)
    assert f.cache_info().currsize == 2


def test_mutating_a_read_setting_changes_the_answer(fake_gpus):
    f = S.is_module_grouped_tensor_supported
    r = R.MXFP8BlockScaling()
    assert f(r, torch.bfloat16, split_alignment=32, device=BLACKWELL) is True
    r.fp8_format = R.Format.E5M2
    assert f(r, torch.bfloat16, split_alignment=32, device=BLACKWELL) is False


@pytest.mark.parametrize("pred", PREDICATES)
def test_wrapped_is_uncached_and_agrees(fake_gpus, pred):
    pred.cache_clear()
    for r, al in [(None, None), (R.MXFP8BlockScaling(), 32), (R.NVFP4BlockScaling(), 16), (R.DelayedScaling(), 16)]:
        for dev in (HOPPER, BLACKWELL, AMPERE, CPU):
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                assert pred.__wrapped__(r, dt, split_alignment=al, device=dev) == pred(r, dt, split_alignment=al, device=dev)
    before = pred.cache_info()
    pred.__wrapped__(None, torch.bfloat16, device=HOPPER)
    assert pred.cache_info() == before


def test_string_and_unindexed_devices(fake_gpus, monkeypatch):
    f = S.is_module_grouped_tensor_supported
    assert f(None, torch.bfloat16, device="cpu") is True
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # "cuda" without index and None follow the *current* device every call
    assert f(R.MXFP8BlockScaling(), torch.bfloat16, split_alignment=32, device="cuda") is True
    assert f(R.MXFP8BlockScaling(), torch.bfloat16, split_alignment=32, device=None) is True
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert f(R.MXFP8BlockScaling(), torch.bfloat16, split_alignment=32, device="cuda") is False
    assert f(R.MXFP8BlockScaling(), torch.bfloat16, split_alignment=32, device=None) is False


def test_errors(fake_gpus):
    f = S.is_module_grouped_tensor_supported
    with pytest.raises(TypeError, match="received str"):
        f("delayed", torch.bfloat16, device=CPU)
    with pytest.raises(TypeError, match="torch.dtype"):
        f(None, "bf16", device=CPU)
    with pytest.raises(ValueError, match="split_alignment"):
        f(R.DelayedScaling(), torch.bfloat16, split_alignment=0, device=CPU)
    with pytest.raises(TypeError, match="device"):
        f(None, torch.bfloat16, device=3.5)


def test_thread_safety(fake_gpus):
    recipes = [None, R.DelayedScaling(), R.MXFP8BlockScaling(), R.NVFP4BlockScaling()]
    devices = [HOPPER, BLACKWELL, AMPERE, CPU]
    expected = {
        (i, j): S.is_module_grouped_tensor_supported.__wrapped__(r, torch.bfloat16, split_alignment=32, device=d)
        for i, r in enumerate(recipes) for j, d in enumerate(devices)
    }
    S.is_module_grouped_tensor_supported.cache_clear()
    errors = []
    barrier = threading.Barrier(4)

    def work():
        barrier.wait()
        for _ in range(200):
            for (i, j), want in expected.items():
                got = S.is_module_grouped_tensor_supported(recipes[i], torch.bfloat16, split_alignment=32, device=devices[j])
                if got != want:
                    errors.append((i, j, got))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    info = S.is_module_grouped_tensor_supported.cache_info()
    assert info.hits + info.misses == 4 * 200 * len(expected)
    assert info.currsize == len(expected)


def test_writing_a_read_setting_gives_a_fresh_key(fake_gpus):
    f = S.is_module_grouped_tensor_supported
    f.cache_clear()
    r = R.Float8CurrentScaling()
    assert f(r, torch.bfloat16, split_alignment=16, device=HOPPER) is True
    first = r._support_key
    assert first is not None  # memoised by the call
    r.fp8_format = R.Format.E5M2  # the recipe resets the memo on the write
    assert r._support_key is None
    assert f(r, torch.bfloat16, split_alignment=16, device=HOPPER) is False
    assert r._support_key is not first and r._support_key.settings == "E5M2"
    assert (f.cache_info().misses, f.cache_info().currsize) == (2, 2)
    r.fp8_format = R.Format.HYBRID  # back to the first settings: the first entry answers again
    assert f(r, torch.bfloat16, split_alignment=16, device=HOPPER) is True
    assert r._support_key is first and f.cache_info().hits == 1


def test_writes_the_check_does_not_read_keep_the_entry(fake_gpus):
    f = S.is_module_grouped_tensor_supported
    f.cache_clear()
    r = R.DelayedScaling()
    f(r, torch.bfloat16, split_alignment=16, device=HOPPER)
    key = r._support_key
    r.margin = 2  # not read by the rule: memo recomputed, same interned key, a cache hit
    r.enable_cutedsl_fused_grouped_mlp = True  # attached public attribute: memo reset too
    assert r._support_key is None
    assert f(r, torch.bfloat16, split_alignment=16, device=HOPPER) is True
    assert r._support_key is key
    del r.enable_cutedsl_fused_grouped_mlp
    assert r._support_key is None
    assert (f.cache_info().hits, f.cache_info().misses) == (1, 1)


def test_copies_and_pickles_drop_the_memo(fake_gpus):
    f = S.is_module_grouped_tensor_supported
    r = R.NVFP4BlockScaling()
    f(r, torch.bfloat16, split_alignment=16, device=BLACKWELL)
    for clone in (copy.copy(r), copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert clone._support_key is None
        clone.disable_2d_quantization = True
        assert f(clone, torch.bfloat16, split_alignment=16, device=BLACKWELL) is False
    assert f(r, torch.bfloat16, split_alignment=16, device=BLACKWELL) is True  # original untouched
    legacy = R.MXFP8BlockScaling()
    del legacy.__dict__["_support_key"]  # an object restored from state saved before the memo existed
    assert f(legacy, torch.bfloat16, split_alignment=32, device=BLACKWELL) is True


def test_write_racing_with_the_memo_store_leaves_no_stale_memo(fake_gpus, monkeypatch):
    """A write landing between the settings read and the memo store must not leave the old key."""
    f = S.is_module_grouped_tensor_supported
    r = R.MXFP8BlockScaling()
    calls = []

    def read_then_race(recipe):
        value = recipe.fp8_format.value
        if not calls:
            recipe.fp8_format = R.Format.E5M2  # the "other thread"'s write
        calls.append(value)
        return value

    monkeypatch.setitem(S._SPECS, R.MXFP8BlockScaling, S._Spec("mxfp8", read_then_race))
    assert f(r, torch.bfloat16, split_alignment=32, device=BLACKWELL) is True  # answered for the read
    assert r._support_key is None  # the stale memo was dropped
    assert f(r, torch.bfloat16, split_alignment=32, device=BLACKWELL) is False  # E5M2 now


def test_concurrent_writer_ends_consistent(fake_gpus):
    f = S.is_module_grouped_tensor_supported
    r = R.MXFP8BlockScaling()
    stop = threading.Event()

    def read():
        while not stop.is_set():
            f(r, torch.bfloat16, split_alignment=32, device=BLACKWELL)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    for i in range(300):
        r.fp8_format = R.Format.E5M2 if i % 2 == 0 else R.Format.E4M3
    r.fp8_format = R.Format.E5M2
    stop.set()
    for t in readers:
        t.join()
    assert f(r, torch.bfloat16, split_alignment=32, device=BLACKWELL) is False
    r.fp8_format = R.Format.E4M3
    assert f(r, torch.bfloat16, split_alignment=32, device=BLACKWELL) is True


def test_current_device_forms_resolve_every_call_and_count_once(fake_gpus, monkeypatch):
    f = S.is_module_grouped_tensor_supported
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    f.cache_clear()
    mx = R.MXFP8BlockScaling()
    for device in (None, "cuda", torch.device("cuda"), None, "cuda"):
        assert f(mx, torch.bfloat16, split_alignment=32, device=device) is True
    assert f(None, torch.bfloat16, device=None) is True
    info = f.cache_info()
    # one hit or miss per call; only the resolved cuda:1 entries are stored (MXFP8 and None)
    assert (info.hits, info.misses, info.currsize) == (4, 2, 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert f(mx, torch.bfloat16, split_alignment=32, device=None) is False
    assert f(None, torch.bfloat16, device="cuda") is True


def test_device_forms_are_answered_for_the_device_they_name(fake_gpus):
    f = S.is_module_grouped_tensor_supported
    mx = R.MXFP8BlockScaling()
    for _ in range(2):  # miss, then hit
        assert f(mx, torch.bfloat16, split_alignment=32, device="cuda:1") is True
        assert f(mx, torch.bfloat16, split_alignment=32, device="cuda:0") is False
        assert f(mx, torch.float32, split_alignment=32, device="cpu") is True
        assert f(mx, torch.bfloat16, split_alignment=32, device=torch.device("cuda", 1)) is True


def test_errors_for_unhashable_and_aliasing_arguments(fake_gpus):
    f = S.is_op_fuser_grouped_tensor_supported
    assert f(None, torch.bfloat16, device=CPU) is True
    with pytest.raises(TypeError, match="device must be .* received list"):
        f(None, torch.bfloat16, device=[0])
    with pytest.raises(ValueError, match="split_alignment must be .* received \\[16\\]"):
        f(R.DelayedScaling(), torch.bfloat16, split_alignment=[16], device=CPU)
    with pytest.raises(TypeError, match="torch.dtype, received list"):
        f(None, [torch.bfloat16], device=CPU)
    with pytest.raises(TypeError, match="received bool"):  # True == 1 must not alias a device index
        f(None, torch.bfloat16, device=True)
    with pytest.raises(ValueError, match="does not name a device"):
        f(None, torch.bfloat16, device="not-a-device")
    with pytest.raises(TypeError, match="received Recipe"):
        f(R.Recipe(), torch.bfloat16, device=CPU)


@pytest.mark.gpu
def test_real_device_answer(cuda_device):
    cap = torch.cuda.get_device_capability(cuda_device)
    got = S.is_module_grouped_tensor_supported(None, torch.bfloat16, device=cuda_device)
    assert got is (cap >= (9, 0))


def test_fp8_rules_need_the_kernels(fake_gpus):
    """Without buildable FP8 kernels every FP8 recipe takes the emulated path; the answer follows the lookup."""
    f = S.is_module_grouped_tensor_supported
    cur, block = R.Float8CurrentScaling(), R.Float8BlockScaling()
    assert f(cur, torch.bfloat16, split_alignment=16, device=HOPPER) is True
    with S.set_fp8_kernels_lookup(lambda: False):
        assert f(cur, torch.bfloat16, split_alignment=16, device=HOPPER) is False
        assert f(block, torch.bfloat16, split_alignment=128, device=HOPPER) is False
        assert f(None, torch.bfloat16, device=HOPPER) is True  # bf16 does not use them
    assert f(block, torch.bfloat16, split_alignment=128, device=HOPPER) is True  # caches cleared on restore


def test_device_capability_is_cached_and_faked(fake_gpus):
    assert S.device_capability(HOPPER) == (9, 0)
    assert S.device_capability(HOPPER) == (9, 0)
    assert S.device_capability(CPU) is None
    assert fake_gpus.count(HOPPER) == 1


def test_explain_path_names_the_path_and_the_reason(fake_gpus):
    explain = S.explain_path
    assert explain(R.Float8BlockScaling(), torch.bfloat16, device=HOPPER)[0] == "native"
    assert explain(R.Float8CurrentScaling(), torch.bfloat16, device=HOPPER)[0] == "native"
    path, why = explain(R.MXFP8BlockScaling(), torch.bfloat16, device=HOPPER)
    assert path == "emulated" and "SM 10.0" in why
    path, why = explain(R.Float8BlockScaling(), torch.bfloat16, device=BLACKWELL)
    assert path == "emulated" and "sm_90a" in why
    path, why = explain(R.Float8BlockScaling(w_block_scaling_dim=1), torch.bfloat16, device=HOPPER)
    assert path == "emulated" and "1/1/1" in why
    assert explain(R.Float8BlockScaling(), torch.bfloat16, device=CPU) == ("emulated", "cpu: the float32 reference path")
    assert explain(None, torch.bfloat16, device=HOPPER)[0] == "native"
    assert explain(None, torch.bfloat16, device=AMPERE)[0] == "split"
    with S.set_fp8_kernels_lookup(lambda: False):
        path, why = explain(R.Float8BlockScaling(), torch.bfloat16, device=HOPPER)
        assert path == "emulated" and "unavailable" in why
