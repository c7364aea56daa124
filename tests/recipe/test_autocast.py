"""autocast: nesting restores the outer recipe; threads see their own recipe."""

import threading

import pytest

import te_dist as td
from te_dist import recipe as R
from te_dist.autocast import get_active_recipe, get_recipe_key


def test_nested_autocast_restores_outer():
    outer, inner = R.DelayedScaling(), R.MXFP8BlockScaling()
    assert get_active_recipe() is None and get_recipe_key() is None
    with td.autocast(recipe=outer):
        assert get_active_recipe() is outer
        with td.autocast(recipe=inner):
            assert get_active_recipe() is inner and get_recipe_key() == str(inner)
            with td.autocast(recipe=outer, enabled=False):
                assert get_active_recipe() is None and get_recipe_key() is None
        assert get_active_recipe() is outer
    assert get_active_recipe() is None


def test_autocast_restores_after_exception():
    with pytest.raises(KeyError):
        with td.autocast(recipe=R.Float8CurrentScaling()):
            raise KeyError("boom")
    assert get_active_recipe() is None


def test_key_follows_setting_changes_inside_block():
    r = R.Float8CurrentScaling()
    with td.autocast(recipe=r):
        before = get_recipe_key()
        r.use_power_2_scales = True
        assert get_recipe_key() != before and "use_power_2_scales=True" in get_recipe_key()


def test_two_threads_see_their_own_recipe():
    recipes = {0: R.DelayedScaling(), 1: R.NVFP4BlockScaling()}
    seen, barrier = {}, threading.Barrier(2)

    def worker(i):
        with td.autocast(recipe=recipes[i]):
            barrier.wait()  # both blocks are open at the same time
            seen[i] = (get_active_recipe(), get_recipe_key())
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen[0] == (recipes[0], str(recipes[0]))
    assert seen[1] == (recipes[1], str(recipes[1]))


def test_bad_arguments():
    with pytest.raises(TypeError, match="expects a te_dist.recipe.Recipe or None, got str"):
        with td.autocast(recipe="delayed"):
            pass
    with pytest.raises(TypeError, match="enabled=.*expects a bool"):
        with td.autocast(recipe=None, enabled="yes"):
            pass
