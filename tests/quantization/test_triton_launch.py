"""TritonLaunch: a repeat launch skips Triton's binding but never reuses a kernel Triton would not.

CPU tests drive it with a fake kernel (the launch logic, no Triton needed); the GPU test launches a
real Triton kernel and checks each key holds the kernel Triton itself picks (``kernel.warmup``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from te_dist.quantization import triton_launch
from te_dist.quantization.triton_launch import TritonLaunch, arg_key, cdiv, next_power_of_2


class FakeCompiled:
    def __init__(self, calls):
        self.calls, self.function, self.packed_metadata = calls, "fn", "meta"

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.calls.append(("fast", (g0, g1, g2), stream, args))


class FakeKernel:
    """Triton's launch surface: ``kernel[grid](*args, **meta)`` binds, launches, returns the compiled kernel."""

    arg_names = ["x_ptr", "n", "alpha", "BLOCK", "FLAG"]

    def __init__(self, compiled_type=FakeCompiled):
        self.calls, self.compiled_type = [], compiled_type

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.calls.append(("slow", grid, args, meta))
            return self.compiled_type(self.calls)
        return run


@pytest.fixture
def fake_cuda(monkeypatch):
    """What TritonLaunch reads from torch and Triton, without either a GPU or Triton."""
    runtime = SimpleNamespace(debug=False, launch_enter_hook=SimpleNamespace(calls=[]),
                              launch_exit_hook=SimpleNamespace(calls=[]))
    knobs = SimpleNamespace(runtime=runtime, compilation=SimpleNamespace(instrumentation_mode=""))
    monkeypatch.setattr(triton_launch, "_runtime_knobs", lambda: knobs)
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_current_stream", lambda device: 1234)
    return knobs


def test_keys_split_every_argument_triton_specializes_differently():
    x = torch.zeros(64)
    different = [  # pairs Triton 3.x gives different specializations (different compiled kernels)
        (1, 2), (16, 17), (0, 1), ((1 << 31) - 16, 1 << 31), ((1 << 63) - 16, 1 << 63), (-16, -15),
        (x, x[1:]), (x, x.to(torch.float64)), (True, 1), (1.0, 1), (None, 0),
    ]
    for a, b in different:
        assert arg_key(a) != arg_key(b), (a, b)
    same = [(32, 48), (17, 19), (x, torch.ones(8)), (x[4:], x[8:]), (0.5, 2.0)]  # one kernel serves both
    for a, b in same:
        assert arg_key(a) == arg_key(b), (a, b)
    assert arg_key((1, 2)) is None and arg_key("s") is None  # not handled: Triton's own path


def test_a_repeat_launch_takes_the_compiled_kernel_with_arguments_in_signature_order(fake_cuda):
    kernel = FakeKernel()
    launcher = TritonLaunch(kernel)
    x = torch.zeros(64)
    launcher((4,), x, 100, 0.5, FLAG=True, BLOCK=128)  # first: Triton's path, remembered
    launcher((8, 2), x, 200, 0.25, FLAG=True, BLOCK=128)  # same key: direct
    assert [c[0] for c in kernel.calls] == ["slow", "fast"]
    assert kernel.calls[1] == ("fast", (8, 2, 1), 1234, (x, 200, 0.25, 128, True))  # constexprs by position
    launcher((8,), x[1:], 200, 0.25, FLAG=True, BLOCK=128)  # misaligned pointer: a new key, Triton's path
    launcher((8,), x, 1, 0.25, FLAG=True, BLOCK=128)  # n == 1 is a constant to Triton: a new key
    launcher((8,), x, 200, 0.25, FLAG=False, BLOCK=128)  # another constexpr value
    assert [c[0] for c in kernel.calls[2:]] == ["slow"] * 3
    launcher((8,), x[5:], 216, 1.5, FLAG=True, BLOCK=128)  # the misaligned key again: direct
    assert kernel.calls[-1][0] == "fast" and kernel.calls[-1][3][1] == 216


def test_calls_it_cannot_key_take_tritons_path_every_time(fake_cuda):
    kernel = FakeKernel()
    launcher = TritonLaunch(kernel)
    x = torch.zeros(64)
    for _ in range(2):
        launcher((4,), x, 100, 0.5, BLOCK=128)  # FLAG left to a default: Triton binds it
        launcher(lambda meta: (4,), x, 100, 0.5, BLOCK=128, FLAG=True)  # a grid function
        launcher((4,), x, 100, 0.5, BLOCK=[128], FLAG=True)  # an unhashable constexpr
        launcher((4,), x, (1, 2), 0.5, BLOCK=128, FLAG=True)  # a tuple argument
    assert [c[0] for c in kernel.calls] == ["slow"] * 8


def test_installed_launch_hooks_get_tritons_path(fake_cuda):
    kernel = FakeKernel()
    launcher = TritonLaunch(kernel)
    x = torch.zeros(64)
    launcher((4,), x, 100, 0.5, BLOCK=128, FLAG=True)
    fake_cuda.runtime.launch_enter_hook.calls.append(lambda metadata: None)  # e.g. a profiler
    launcher((4,), x, 100, 0.5, BLOCK=128, FLAG=True)
    fake_cuda.runtime.launch_enter_hook.calls.clear()
    launcher((4,), x, 100, 0.5, BLOCK=128, FLAG=True)
    assert [c[0] for c in kernel.calls] == ["slow", "slow", "fast"]


def test_a_kernel_without_the_launch_interface_keeps_tritons_path(fake_cuda):
    kernel = FakeKernel(compiled_type=lambda calls: None)  # e.g. the interpreter returns nothing
    launcher = TritonLaunch(kernel)
    x = torch.zeros(64)
    for _ in range(3):
        launcher((4,), x, 100, 0.5, BLOCK=128, FLAG=True)
    assert len(kernel.calls) == 3 and not launcher.fast


def test_host_grid_helpers_match_their_definitions():
    for a in range(0, 70):
        for b in (1, 4, 16, 128):
            assert cdiv(a, b) == (a + b - 1) // b
    for n in range(1, 3000):
        p = next_power_of_2(n)
        assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_each_key_launches_the_kernel_triton_picks():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def scale_copy(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * alpha, mask=offs < n)

    launcher = TritonLaunch(scale_copy)
    base = torch.randn(4096, device="cuda")
    out = torch.zeros(4096, device="cuda")
    cases = [(0, 1), (0, 16), (0, 17), (1, 16), (3, 1000), (0, 4000), (4, 31), (0, 1), (1, 16), (0, 48)]
    for offset, n in cases * 2:
        x, y = base[offset:offset + n], out[offset:offset + n]
        y.zero_()
        launcher((cdiv(n, 128),), x, y, n, 0.5, BLOCK=128)
        torch.testing.assert_close(y, x * 0.5, rtol=0, atol=0)
        key = launcher.key((cdiv(n, 128),), (x, y, n, 0.5), {"BLOCK": 128})
        assert launcher.compiled[key] is scale_copy.warmup(x, y, n, 0.5, BLOCK=128, grid=(1,))
    assert launcher.fast and 4 <= len(launcher.compiled) < len(cases)
