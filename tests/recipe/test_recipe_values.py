"""Attached recipe attributes: typos of settings refused, containers read-only, safe dict loading."""

import copy
import dataclasses
import os
import pickle

import pytest
import torch

from te_dist import recipe as R
from te_dist.recipe_values import near_miss


def test_attached_public_attribute_stays_in_the_string():
    r = R.MXFP8BlockScaling()
    r.enable_cutedsl_fused_grouped_mlp = True
    assert str(r).endswith("enable_cutedsl_fused_grouped_mlp=True)")


@pytest.mark.parametrize(
    "cls, typo, setting",
    [
        (R.DelayedScaling, "margn", "margin"),
        (R.DelayedScaling, "Margin", "margin"),
        (R.DelayedScaling, "amax_histroy_len", "amax_history_len"),  # swapped neighbours: one edit
        (R.Float8CurrentScaling, "use_power2_scales", "use_power_2_scales"),
        (R.NVFP4BlockScaling, "fp4_quant_fwd_inpt", "fp4_quant_fwd_inp"),  # derived property
    ],
)
def test_near_miss_of_a_setting_raises_with_a_hint(cls, typo, setting):
    r = cls()
    text = str(r)
    with pytest.raises(AttributeError, match=f"no setting '{typo}'; did you mean '{setting}'"):
        setattr(r, typo, 2)
    assert typo not in r.__dict__ and str(r) is text


def test_unknown_keyword_names_the_near_setting():
    with pytest.raises(TypeError, match=r"did you mean 'margin' for 'margn'"):
        R.DelayedScaling(margn=1)


def test_distant_names_are_not_near_misses():
    assert near_miss("enable_fused_grouped_mlp", ["margin", "fp8_format", "amax_history_len"]) is None
    assert near_miss("mrgn", ["margin"]) is None  # two edits on a short name
    assert near_miss("margin", ["margin"]) is None


def test_attached_containers_are_read_only_and_the_string_cannot_go_stale():
    r = R.DelayedScaling()
    r.opts = {"a": 1, "nested": [1, {"b": 2}], "s": {3}}
    text = str(r)
    with pytest.raises(TypeError, match="read-only"):
        r.opts["a"] = 2
    with pytest.raises(TypeError, match="read-only"):
        r.opts["nested"].append(3)
    with pytest.raises(TypeError, match="read-only"):
        r.opts["nested"][1]["b"] = 3
    with pytest.raises(TypeError, match="read-only"):
        r.opts.update(a=5)
    assert str(r) is text and "opts={'a': 1, 'nested': [1, {'b': 2}], 's': {3}}" in text
    source = {"a": 1}
    r.more = source
    source["a"] = 2  # the caller's dict is not the stored one
    assert r.more == {"a": 1} and "more={'a': 1}" in str(r)
    r.opts = {"a": 2}  # assignment is the way to change it, and the string follows
    assert "opts={'a': 2}" in str(r)


def test_frozen_containers_survive_copies():
    r = R.Float8BlockScaling()
    r.opts = {"a": [1, 2]}
    for clone in (copy.deepcopy(r), pickle.loads(pickle.dumps(r)), R.Recipe.from_dict(r.to_dict())):
        assert clone == r
        with pytest.raises(TypeError, match="read-only"):
            clone.opts["a"].append(3)


@dataclasses.dataclass
class Mutable:
    x: int = 1


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: int = 1
    xs: tuple = (1, 2)


def test_values_the_string_could_not_follow_are_refused():
    r = R.DelayedScaling()
    text = str(r)
    with pytest.raises(TypeError, match="cannot attach a torch.Tensor"):
        r.scale = torch.ones(2)
    with pytest.raises(TypeError, match="Mutable can change after it is attached"):
        r.cfg = Mutable()
    with pytest.raises(TypeError, match="cannot attach a builtins.bytearray"):
        r.raw = bytearray(b"x")
    assert str(r) is text
    r.cfg = Frozen()
    assert f"cfg={Frozen.__qualname__}(x=1, xs=(1, 2))" in str(r)


def test_from_dict_never_imports_an_unlisted_callable():
    data = {"type": "DelayedScaling", "hook": {"callable": "os:system"}}
    with pytest.raises(ValueError, match="'os:system', which is not allowed"):
        R.Recipe.from_dict(data)
    with pytest.raises(ValueError, match="not allowed"):  # declared settings too
        R.Recipe.from_dict({"type": "DelayedScaling", "amax_compute_algo": {"callable": "os:system"}})
    assert R.Recipe.from_dict(data, callables={"os:system": os.system}).hook is os.system  # allowed: no import
    listed = R.Recipe.from_dict({"type": "DelayedScaling", "amax_compute_algo": {"callable": f"{__name__}:Frozen"}},
                                callables=[Frozen])
    assert listed.amax_compute_algo is Frozen  # matched by the module:qualname that to_dict writes
    assert R.Recipe.from_dict(data, import_callables=True).hook is os.system  # explicit opt-in


def test_from_dict_coerces_only_declared_format_settings():
    r = R.Recipe.from_dict({"type": "DelayedScaling", "fp8_format": "E4M3", "my_format": "E4M3"})
    assert r.fp8_format is R.Format.E4M3
    assert r.my_format == "E4M3"  # an attached key keeps its value, whatever its name ends with
    r.alt = R.Format.E5M2  # an attached Format round-trips through its tagged form
    d = r.to_dict()
    assert d["alt"] == {"format": "E5M2"} and d["fp8_format"] == "E4M3"
    assert R.Recipe.from_dict(d) == r
    with pytest.raises(ValueError, match="unknown format 'E9M9'"):
        R.Recipe.from_dict({"type": "DelayedScaling", "alt": {"format": "E9M9"}})


def test_from_dict_near_miss_is_a_value_error():
    with pytest.raises(ValueError, match="recipe dict key 'margn'.*did you mean 'margin'"):
        R.Recipe.from_dict({"type": "DelayedScaling", "margn": 1})


def test_describe_settings_matches_the_string():
    r = R.DelayedScaling(margin=2)
    r.extra = (R.Format.E4M3,)
    described = r.describe_settings()
    assert described["margin"] == "2" and described["extra"] == "(Format.E4M3,)"
    assert str(r) == "DelayedScaling(" + ", ".join(f"{k}={v}" for k, v in described.items()) + ")"
