"""te_dist.lazy_import.optional_module: a kernel file that may not import (no Triton on CI)."""

import uuid
import warnings

import pytest

from te_dist import lazy_import


def test_optional_module_imports_once_and_a_missing_one_warns_once_then_answers_none():
    missing = f".no_such_module_{uuid.uuid4().hex}"  # a name no earlier call asked for
    with pytest.warns(UserWarning, match="the test kernels unavailable .*; using the fallback"):
        assert lazy_import.optional_module(missing, "te_dist", "the test kernels", "the fallback") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second ask neither imports again nor warns again
        assert lazy_import.optional_module(missing, "te_dist", "the test kernels", "the fallback") is None
        present = lazy_import.optional_module(".recipe", "te_dist", "the recipes", "nothing")
    import te_dist.recipe

    assert present is te_dist.recipe
