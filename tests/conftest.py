"""Shared test setup: the harness import path and the one place that decides GPU skips."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from harness import run_torchrun`


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a setup error reported elsewhere
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine; not counted as a pass here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def cuda_device():
    """The CUDA device for GPU tests (tests using it must also carry @pytest.mark.gpu)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def copies(monkeypatch):
    """The shape of every weight copy cast (te_dist.kernels.prepare_quantized_weight calls), in order."""
    from te_dist import kernels

    made = []
    real = kernels.prepare_quantized_weight
    monkeypatch.setattr(kernels, "prepare_quantized_weight", lambda q: made.append(tuple(q.shape)) or real(q))
    return made
