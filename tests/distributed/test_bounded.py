"""Argument checks of the bounded collectives: bad timeouts fail before any collective starts."""

import pytest
import torch

from te_dist.distributed.all_to_all import all_to_all_tokens, exchange_counts
from te_dist.distributed.bounded import check_timeout_s
from te_dist.moe.transports import AllToAllDispatcher


def test_check_timeout_s():
    assert check_timeout_s(None) is None
    assert check_timeout_s(3) == 3.0
    for bad, error in ((0, ValueError), (-1.5, ValueError), ("5", TypeError), (True, TypeError)):
        with pytest.raises(error, match="timeout_s"):
            check_timeout_s(bad)


def test_bad_timeouts_are_rejected_at_every_entry():
    with pytest.raises(ValueError, match="timeout_s must be > 0 seconds, got 0"):
        all_to_all_tokens(torch.zeros(2, 4), [2], [2], None, timeout_s=0)
    with pytest.raises(TypeError, match="timeout_s must be seconds"):
        exchange_counts(torch.zeros(2, dtype=torch.int64), None, timeout_s="1")
    with pytest.raises(ValueError, match="timeout_s"):
        AllToAllDispatcher(4, None, timeout_s=-1)
