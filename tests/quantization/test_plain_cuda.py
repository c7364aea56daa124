"""The plain CUDA casts' libraries (``te_dist.quantization.plain_cuda.PlainLibrary``): nothing is built before the
first use; a library opened once is kept; one that cannot be built warns once and stays unavailable (no rebuild on
every call), so the casts keep their Triton path. CPU: the build itself is faked."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from cutlass_kernels import build
from te_dist.quantization.plain_cuda import PlainLibrary

ROOT = Path(__file__).resolve().parents[2]


def test_a_library_is_opened_on_its_first_use_and_kept(monkeypatch):
    calls = []
    monkeypatch.setattr(build, "open_plain_source", lambda source, open_fn: calls.append(source) or open_fn(source))
    lib = PlainLibrary(Path("/nowhere/k.cu"), lambda path: f"opened {path.name}", "the k cast", "k's fallback runs")
    assert not lib.tried and not calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lib.get() == "opened k.cu" and lib.get() == "opened k.cu"
    assert calls == [Path("/nowhere/k.cu")] and lib.tried and lib.error is None


def test_a_library_that_cannot_be_built_warns_once_and_stays_unavailable(monkeypatch):
    calls = []

    def fail(source, open_fn):
        calls.append(source)
        raise build.BuildError("nvcc failed: broken.cu:1: error")

    monkeypatch.setattr(build, "open_plain_source", fail)
    lib = PlainLibrary(Path("/nowhere/broken.cu"), lambda path: path, "the broken cast", "the Triton cast runs instead")
    with pytest.warns(UserWarning, match=r"the broken cast \(broken.cu\) is unavailable .*nvcc failed.*the Triton "
                                         r"cast runs instead"):
        assert lib.get() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert lib.get() is None
    assert len(calls) == 1 and "nvcc failed" in lib.error


def test_each_cast_has_its_own_library_and_none_is_built_at_import():
    """Importing the casts' ctypes views builds nothing and does not even import the kernel build."""
    code = ("import sys; from te_dist.quantization import cuda_blocks as b, cuda_rowcol as r; "
            "assert b._LIBRARY.source.name == 'cast_blocks.cu' and r._LIBRARY.source.name == 'cast_rowcol.cu'; "
            "assert not b._LIBRARY.tried and not r._LIBRARY.tried; assert 'cutlass_kernels' not in sys.modules; "
            "print('ok')")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_launch_takes_the_devices_stream_last_and_a_refusal_raises_the_librarys_words(monkeypatch):
    """``launch_on``: the arguments as given, then the current stream of the tensor's device; a non-zero return
    raises with ``<prefix>_last_error``'s text. CPU: the device queries and the library are faked."""
    import contextlib
    import types

    import torch

    from te_dist.quantization.plain_cuda import launch_on

    calls, switched = [], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=77))
    monkeypatch.setattr(torch.cuda, "device", lambda device: switched.append(device) or contextlib.nullcontext())
    lib = types.SimpleNamespace(te_xx_cast=lambda *args: calls.append(args) or (0 if args[0] else 3),
                                te_xx_last_error=lambda: b"rows 100 off the tile")
    launch_on(lib, "te_xx_cast", torch.device("cuda", 0), 1, 2.5, None)
    assert calls == [(1, 2.5, None, 77)] and switched == []  # on the current device: no switch
    launch_on(lib, "te_xx_cast", torch.device("cuda", 1), 5)
    assert calls[-1] == (5, 77) and switched == [torch.device("cuda", 1)]  # another device: switched to it
    with pytest.raises(RuntimeError, match="te_xx_cast launch failed: rows 100 off the tile"):
        launch_on(lib, "te_xx_cast", torch.device("cuda", 0), 0)
