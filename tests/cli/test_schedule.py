"""The learning-rate schedule: a pure function of (step, config), so a resumed run gets the same rates."""

import math

import pytest

from te_dist.train.config import JobConfig, config_from_dict
from te_dist.train.loop import lr_at


def test_warmup_then_cosine_to_the_floor():
    cfg = config_from_dict({"train": {"steps": 20, "lr": 0.01, "warmup_steps": 4, "min_lr_ratio": 0.1}})
    rates = [lr_at(s, cfg) for s in range(1, 21)]
    assert rates[:4] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])
    assert all(a >= b for a, b in zip(rates[3:], rates[4:]))  # non-increasing after warm-up
    assert rates[-1] == pytest.approx(0.001)
    mid = lr_at(12, cfg)  # halfway through the decay: midpoint of peak and floor
    assert mid == pytest.approx(0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_no_warmup():
    cfg = JobConfig()
    cfg.train.warmup_steps = 0
    assert lr_at(1, cfg) < cfg.train.lr and lr_at(1, cfg) > 0.99 * cfg.train.lr
