"""Fixtures shared by the op tests."""

import pytest

from te_dist import kernels


@pytest.fixture
def copies(monkeypatch):
    """The shape of every weight copy cast (prepare_quantized_weight calls), in order."""
    made = []
    real = kernels.prepare_quantized_weight
    monkeypatch.setattr(kernels, "prepare_quantized_weight", lambda q: made.append(tuple(q.shape)) or real(q))
    return made
