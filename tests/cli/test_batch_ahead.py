"""te-dist train's look-ahead batch (te_dist/train/batch_ahead.py): the same batches, errors at their own step."""

import pytest
import torch

from te_dist.train.batch_ahead import BatchAhead


class _Data:
    """A batch per step; step 3 cannot be read. Records the steps built."""

    def __init__(self):
        self.built = []

    def local_batch(self, step, rank, world_size):
        self.built.append(step)
        if step == 3:
            raise OSError("step 3's windows cannot be read")
        x = torch.full((2, 4), step * 10 + rank, dtype=torch.int64)
        return x, x + world_size


def test_a_batch_built_ahead_is_the_batch_of_its_step_and_only_of_it():
    data = _Data()
    ahead = BatchAhead(data, rank=1, world_size=2)
    first = ahead.take(1)  # nothing built ahead: built now
    ahead.build(2)
    assert data.built == [1, 2]
    second = ahead.take(2)  # the one built ahead: not built again
    assert data.built == [1, 2]
    assert torch.equal(first[0], torch.full((2, 4), 11)) and torch.equal(second[1], torch.full((2, 4), 23))
    ahead.build(5)  # a step that never comes (the run stopped, or resumed elsewhere) is not handed to another
    assert torch.equal(ahead.take(4)[0], torch.full((2, 4), 41)) and data.built == [1, 2, 5, 4]
    assert torch.equal(ahead.take(5)[0], torch.full((2, 4), 51))  # taken once: the next take builds again


def test_an_error_building_ahead_is_raised_at_the_step_whose_batch_it_is():
    data = _Data()
    ahead = BatchAhead(data, rank=0, world_size=1)
    ahead.build(3)  # the error is kept, not raised here
    with pytest.raises(OSError, match="step 3's windows"):
        ahead.take(3)
    assert torch.equal(ahead.take(2)[0], torch.full((2, 4), 20))
