"""Recipes: cached string, invalidation, derived settings, validation, copies and dict round trips."""

import copy
import pickle

import pytest

from te_dist import recipe as R

ALL_CLASSES = [R.DelayedScaling, R.Float8CurrentScaling, R.Float8BlockScaling, R.MXFP8BlockScaling, R.NVFP4BlockScaling]


def custom_amax(history):
    """A module-level amax algorithm: pickles by name and renders by qualified name."""
    return history.max()


@pytest.mark.parametrize("cls", ALL_CLASSES)
def test_string_lists_class_and_every_setting_in_order(cls):
    r = cls()
    text = str(r)
    assert text.startswith(f"{cls.__name__}(")
    positions = [text.index(f"{s.name}=") for s in cls._SETTINGS]
    assert positions == sorted(positions)
    assert " at 0x" not in text


@pytest.mark.parametrize("cls", ALL_CLASSES)
def test_second_read_returns_the_cached_object(cls):
    r = cls()
    assert str(r) is str(r)


def test_declared_write_invalidates():
    r = R.DelayedScaling()
    before = str(r)
    r.margin = 3
    after = str(r)
    assert after != before and "margin=3" in after
    assert str(r) is after


def test_new_public_attribute_invalidates_and_sorts_after_declared():
    r = R.Float8BlockScaling()
    before = str(r)
    r.enable_fused_grouped_mlp = False
    r.a_flag = 1
    text = str(r)
    assert text != before
    assert text.endswith("backward_override=None, a_flag=1, enable_fused_grouped_mlp=False)")


def test_delete_attribute_invalidates():
    r = R.MXFP8BlockScaling()
    base = str(r)
    r.enable_cutedsl_fused_grouped_mlp = True
    assert str(r) != base
    del r.enable_cutedsl_fused_grouped_mlp
    assert str(r) == base


def test_private_attributes_are_not_part_of_identity():
    r = R.Float8CurrentScaling()
    text = str(r)
    r._scratch = object()
    assert str(r) is text
    assert r == R.Float8CurrentScaling()


def test_declared_settings_cannot_be_deleted():
    r = R.DelayedScaling()
    with pytest.raises(AttributeError, match="cannot delete declared setting DelayedScaling.margin"):
        del r.margin


def test_callable_renders_by_qualified_name():
    r = R.DelayedScaling(amax_compute_algo=custom_amax)
    assert f"amax_compute_algo={__name__}.custom_amax" in str(r)


def test_nvfp4_derived_params_follow_writes():
    r = R.NVFP4BlockScaling()
    assert r.fp4_quant_bwd_grad == R.QParams(random_hadamard_transform=True, stochastic_rounding=True)
    assert r.fp4_quant_fwd_weight.fp4_2d_quantization
    r.disable_stochastic_rounding = True
    r.disable_rht = True
    r.disable_2d_quantization = True
    assert r.fp4_quant_bwd_grad == R.QParams()
    assert r.fp4_quant_fwd_inp == R.QParams()
    assert not r.fp4_quant_fwd_weight.fp4_2d_quantization
    with pytest.raises(AttributeError, match="derived"):
        r.fp4_quant_bwd_grad = R.QParams()


def test_format_directions():
    assert R.Format.HYBRID.forward is R.Format.E4M3
    assert R.Format.HYBRID.backward is R.Format.E5M2
    assert R.Format.HYBRID.for_role("grad_output") is R.Format.E5M2
    assert R.Format.E4M3.max == 448.0 and R.Format.E5M2.max == 57344.0 and R.Format.E2M1.max == 6.0
    with pytest.raises(ValueError, match="not a concrete format"):
        R.Format.HYBRID.max


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "cls, kwargs, exc, match",
    [
        (R.DelayedScaling, {"marginn": 1}, TypeError, r"DelayedScaling got unexpected keyword\(s\) \['marginn'\]"),
        (R.DelayedScaling, {"margin": -1}, ValueError, "DelayedScaling.margin must be >= 0, got -1"),
        (R.DelayedScaling, {"margin": 1.5}, TypeError, "DelayedScaling.margin must be an int, got float"),
        (R.DelayedScaling, {"amax_history_len": 0}, ValueError, "amax_history_len must be >= 1, got 0"),
        (R.DelayedScaling, {"amax_compute_algo": "mean"}, ValueError, "'max', 'most_recent' or a callable"),
        (R.DelayedScaling, {"reduce_amax": 1}, TypeError, "reduce_amax must be a bool, got int"),
        (R.DelayedScaling, {"fp8_format": R.Format.E2M1}, ValueError, "fp8_format must be one of E4M3, E5M2, HYBRID, got E2M1"),
        (R.DelayedScaling, {"fp8_format": "E4M3"}, TypeError, "must be a te_dist.recipe.Format, got str"),
        (R.Float8CurrentScaling, {"use_power_2_scales": "yes"}, TypeError, "use_power_2_scales must be a bool"),
        (R.Float8BlockScaling, {"x_block_scaling_dim": 3}, ValueError, "x_block_scaling_dim must be 1 .* or 2 .*, got 3"),
        (R.Float8BlockScaling, {"fp8_format": R.Format.E5M2}, ValueError, "must be one of E4M3, HYBRID, got E5M2"),
        (R.Float8BlockScaling, {"x_block_scaling_dim": 2, "grad_block_scaling_dim": 2}, ValueError, "128x128 by 128x128"),
        (R.MXFP8BlockScaling, {"margin": -2}, ValueError, "MXFP8BlockScaling.margin must be >= 0"),
        (R.NVFP4BlockScaling, {"disable_rht": None}, TypeError, "NVFP4BlockScaling.disable_rht must be a bool"),
        (R.NVFP4BlockScaling, {"backward_override": "fp32"}, ValueError, "backward_override must be one of"),
    ],
)
def test_validation_errors(cls, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cls(**kwargs)


def test_rejected_write_leaves_recipe_untouched():
    r = R.Float8BlockScaling(x_block_scaling_dim=2)
    text = str(r)
    with pytest.raises(ValueError, match="128x128 by 128x128"):
        r.grad_block_scaling_dim = 2
    with pytest.raises(ValueError):
        r.w_block_scaling_dim = 5
    assert r.grad_block_scaling_dim == 1 and r.w_block_scaling_dim == 2
    assert str(r) is text


# ------------------------------------------------------------------------------ copies and dicts


@pytest.mark.parametrize("cls", ALL_CLASSES)
def test_deepcopy_pickle_and_dict_round_trip_keep_dynamic_attributes(cls):
    r = cls()
    r.enable_fused_grouped_mlp = False
    for clone in (copy.deepcopy(r), pickle.loads(pickle.dumps(r)), R.Recipe.from_dict(r.to_dict())):
        assert type(clone) is cls
        assert clone == r and str(clone) == str(r)
        assert clone.enable_fused_grouped_mlp is False
        clone.enable_fused_grouped_mlp = True  # clones are independent and their caches work
        assert clone != r and "enable_fused_grouped_mlp=True" in str(clone)


def test_dict_round_trip_with_callable_and_derived():
    r = R.DelayedScaling(amax_compute_algo=custom_amax, margin=2)
    d = r.to_dict()
    assert d["amax_compute_algo"] == {"callable": f"{__name__}:custom_amax"}
    assert R.Recipe.from_dict(d, callables=[custom_amax]) == r
    assert R.Recipe.from_dict(d, import_callables=True) == r
    with pytest.raises(ValueError, match="not allowed; pass it to Recipe.from_dict"):
        R.Recipe.from_dict(d)
    n = R.Recipe.from_dict({"type": "NVFP4BlockScaling", "disable_rht": True})
    assert not n.fp4_quant_bwd_grad.random_hadamard_transform


def test_from_dict_errors():
    with pytest.raises(ValueError, match="needs a 'type' key"):
        R.Recipe.from_dict({"margin": 1})
    with pytest.raises(ValueError, match="unknown recipe type 'Fp8'"):
        R.Recipe.from_dict({"type": "Fp8"})
    with pytest.raises(ValueError, match="unknown format 'E9M9'"):
        R.Recipe.from_dict({"type": "DelayedScaling", "fp8_format": "E9M9"})


def test_equality_compares_settings_not_identity():
    a, b = R.DelayedScaling(margin=1), R.DelayedScaling(margin=1)
    assert a == b and hash(a) == hash(b)
    assert a != R.DelayedScaling(margin=2)
    assert R.Float8CurrentScaling() != R.Float8BlockScaling()


def test_recipe_from_name():
    assert R.recipe_from_name("none") is None
    assert isinstance(R.recipe_from_name("block"), R.Float8BlockScaling)
    assert R.recipe_from_name("delayed", margin=2).margin == 2
    with pytest.raises(ValueError, match="unknown recipe name 'fp9'"):
        R.recipe_from_name("fp9")
