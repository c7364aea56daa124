"""EP/EDP group layout and the single-process behaviour and validation of the token all-to-all."""

import pytest
import torch

from te_dist.distributed.all_to_all import all_to_all_tokens, exchange_counts
from te_dist.distributed.groups import _layout, group_rank, group_size, init_expert_parallel_groups


def test_layout_contiguous_ep_blocks_and_strided_edp():
    ep, edp = _layout(8, 4)
    assert ep == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert edp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    ep, edp = _layout(4, 1)
    assert ep == [[0], [1], [2], [3]] and edp == [[0, 1, 2, 3]]


def test_no_process_group_means_ep1():
    groups = init_expert_parallel_groups(1)
    assert groups.ep_group is None and groups.ep_size == 1
    assert group_size(None) == 1 and group_rank(None) == 0
    with pytest.raises(ValueError, match="ep_size=2"):
        init_expert_parallel_groups(2)
    with pytest.raises(ValueError, match="ep_size must be >= 1"):
        init_expert_parallel_groups(0)


def test_all_to_all_group_of_one_is_identity_with_autograd():
    x = torch.randn(5, 3, requires_grad=True)
    y = all_to_all_tokens(x, [5], [5], None)
    assert y is x
    counts = torch.tensor([2, 0, 3])
    out = exchange_counts(counts, None)
    assert out.tolist() == [2, 0, 3] and out is not counts


def test_all_to_all_validation_before_any_collective():
    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match="input splits sum to 4 but x has 5 rows"):
        all_to_all_tokens(x, [4], [4], None)
    with pytest.raises(ValueError, match="one entry per rank"):
        all_to_all_tokens(x, [5, 0], [5], None)
    with pytest.raises(ValueError, match="negative"):
        all_to_all_tokens(x, [-1], [5], None)
    with pytest.raises(TypeError, match="int64"):
        exchange_counts(torch.tensor([1.0, 2.0]), None)
