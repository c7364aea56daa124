"""Recipe consensus in one process: local no-op, argument errors, digests, the mismatch report."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

import te_dist as td
from te_dist import recipe as R
from te_dist.autocast import get_active_recipe, get_recipe_key
from te_dist.distributed import ConsensusError, RecipeMismatchError, sync_recipe
from te_dist.distributed.consensus import (
    agree_recipe_key,
    describe_recipe_mismatch,
    recipe_digest,
    recipe_payload,
    reset_consensus_state,
)


def test_without_process_group_is_a_local_noop():
    assert not dist.is_initialized()
    r = R.DelayedScaling(margin=2)
    assert sync_recipe(r) is str(r)  # the cached string itself: no copy, no collective
    assert sync_recipe(None) is None


def test_group_without_process_group_is_an_error():
    with pytest.raises(ValueError, match="not initialised"):
        sync_recipe(R.DelayedScaling(), group=object())
    with pytest.raises(ValueError, match="not initialised"):
        with td.autocast(recipe=R.DelayedScaling(), group=object()):
            pass
    assert get_active_recipe() is None  # nothing was pushed


@pytest.mark.parametrize("bad", ["DelayedScaling", 3, R.Format.E4M3])
def test_non_recipe_is_a_type_error(bad):
    with pytest.raises(TypeError, match="expects a te_dist.recipe.Recipe or None, got"):
        sync_recipe(bad)


@pytest.mark.parametrize("timeout, exc", [(0, ValueError), (-1.0, ValueError), ("5", TypeError), (True, TypeError)])
def test_bad_timeout(timeout, exc):
    with pytest.raises(exc, match="timeout"):
        sync_recipe(R.DelayedScaling(), timeout=timeout)


def test_digest_is_deterministic_and_fits_the_min_max_trick():
    key = str(R.Float8BlockScaling())
    d = recipe_digest(key)
    assert d == recipe_digest(str(R.Float8BlockScaling()))
    assert 0 <= d < 2**62 and -d >= -(2**63)
    other = R.Float8BlockScaling()
    other.enable_cutedsl_fused_grouped_mlp = True
    assert recipe_digest(str(other)) != d
    assert recipe_digest("None") != d


def test_mismatch_report_groups_ranks_and_lists_only_differences():
    a = R.DelayedScaling()
    b = R.DelayedScaling(margin=1)
    c = R.DelayedScaling()
    c.enable_fused_grouped_mlp = False
    payloads = [recipe_payload(a), recipe_payload(b), recipe_payload(a), recipe_payload(b), recipe_payload(c)]
    message, mismatched = describe_recipe_mismatch(payloads, [4, 5, 6, 7, 8])
    assert mismatched == [1, 3, 4]
    assert "ranks 1 (global 5), 3 (global 7), 4 (global 8) differ from rank 0 (global 4)" in message
    assert "ranks 1 (global 5), 3 (global 7) vs rank 0 (global 4):\n    margin: 0 on rank 0 (global 4), 1 on" in message
    assert "enable_fused_grouped_mlp: not set on rank 0 (global 4), False on rank 4 (global 8)" in message
    assert "amax_history_len" not in message


def test_mismatch_report_for_different_classes_and_no_recipe():
    payloads = [recipe_payload(R.MXFP8BlockScaling()), recipe_payload(R.NVFP4BlockScaling()), recipe_payload(None)]
    message, mismatched = describe_recipe_mismatch(payloads, [0, 1, 2])
    assert mismatched == [1, 2]
    assert "recipe class: MXFP8BlockScaling on rank 0, NVFP4BlockScaling on rank 1" in message
    assert "only rank 1 has: disable_rht=False" in message
    assert "MXFP8BlockScaling on rank 0, no recipe on rank 2" in message


def test_callable_setting_is_reported_by_name():
    def my_amax(history):
        return history.max()

    payloads = [recipe_payload(R.DelayedScaling()), recipe_payload(R.DelayedScaling(amax_compute_algo=my_amax))]
    message, _ = describe_recipe_mismatch(payloads, [0, 1])
    assert "amax_compute_algo: 'max' on rank 0, " in message and "my_amax on rank 1" in message
    assert " at 0x" not in message


@pytest.fixture
def single_rank_world(tmp_path):
    """A real (gloo) process group of one rank, torn down afterwards."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    reset_consensus_state()
    try:
        yield dist.group.WORLD
    finally:
        reset_consensus_state()
        dist.destroy_process_group()


def test_single_rank_group_agrees_with_itself(single_rank_world):
    r = R.Float8CurrentScaling()
    assert sync_recipe(r) == str(r)
    assert sync_recipe(r, group=single_rank_world) == str(r)
    with td.autocast(recipe=r, group=single_rank_world):
        assert get_recipe_key() == str(r)
    with td.autocast(recipe=None, group=single_rank_world):
        assert get_recipe_key() is None


def test_agreed_key_is_frozen_inside_the_block(single_rank_world):
    r = R.Float8CurrentScaling()
    with td.autocast(recipe=r, group=single_rank_world):
        agreed = get_recipe_key()
        r.use_power_2_scales = True
        assert get_recipe_key() == agreed != str(r)  # plans keep the agreed key until the next entry
        assert get_active_recipe() is r
    with td.autocast(recipe=r, group=single_rank_world):
        assert get_recipe_key() == str(r)  # the next consensus point picks the change up


def test_without_group_the_key_follows_the_recipe():
    r = R.Float8CurrentScaling()
    with td.autocast(recipe=r):
        r.use_power_2_scales = True
        assert get_recipe_key() == str(r)


def test_error_types_are_runtime_errors():
    # Callers that catch RuntimeError around a training step also catch consensus failures.
    assert issubclass(RecipeMismatchError, RuntimeError) and issubclass(ConsensusError, RuntimeError)
    assert agree_recipe_key(None, None) is None


def test_consensus_state_does_not_keep_a_destroyed_group_alive(tmp_path):
    """A gloo group kept alive past destroy_process_group() is torn down at interpreter exit and aborts."""
    import gc
    import weakref

    from te_dist.distributed import consensus

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        state = consensus._REGISTRY.get(group, 5.0)
        assert consensus._REGISTRY.lookup(group) is state
        ref = weakref.ref(group)
        del group
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert ref() is None
    reset_consensus_state()
