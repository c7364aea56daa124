"""Support predicates: device-keyed answers, caching, thread safety (capability lookup injected)."""

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

    with S.set_capability_lookup(lookup):
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
    assert f(R.Float8BlockScaling(), torch.bfloat16, split_alignment=128, device=HOPPER) is S.FP8_BLOCK_KERNELS
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


@pytest.mark.gpu
def test_real_device_answer(cuda_device):
    cap = torch.cuda.get_device_capability(cuda_device)
    got = S.is_module_grouped_tensor_supported(None, torch.bfloat16, device=cuda_device)
    assert got is (cap >= (9, 0))
