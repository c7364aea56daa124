"""Megatron fp8/fp4 config fields -> te_dist recipes, and the spec's recipe option."""

import dataclasses

import pytest

import te_dist.recipe as R
from te_dist.megatron import recipe_from_megatron_config, resolve_recipe


def _config(**fields):
    """A real TransformerConfig with fp8/fp4 fields set after construction (Megatron would refuse
    fp8 on an MoE config without TransformerEngine; the mapping only reads the fields)."""
    import mcore_helpers as H

    config = H.make_config()
    for name, value in fields.items():
        assert name in {f.name for f in dataclasses.fields(config)}, f"Megatron has no field {name}"
        setattr(config, name, value)
    return config


def test_no_quantization_fields_gives_none():
    assert recipe_from_megatron_config(_config()) is None


def test_delayed_maps_every_field():
    got = recipe_from_megatron_config(_config(
        fp8="hybrid", fp8_recipe="delayed", fp8_margin=2, fp8_amax_history_len=16, fp8_amax_compute_algo="max",
    ))
    assert got == R.DelayedScaling(margin=2, fp8_format=R.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    # Megatron's defaults (history 1, most_recent) are kept, not te_dist's.
    default = recipe_from_megatron_config(_config(fp8="e4m3"))
    assert default == R.DelayedScaling(fp8_format=R.Format.E4M3, amax_history_len=1, amax_compute_algo="most_recent")


@pytest.mark.parametrize("name, expected", [
    ("tensorwise", R.Float8CurrentScaling(fp8_format=R.Format.E4M3)),
    ("blockwise", R.Float8BlockScaling(fp8_format=R.Format.E4M3)),
    ("mxfp8", R.MXFP8BlockScaling(fp8_format=R.Format.E4M3)),
])
def test_fp8_recipe_names(name, expected):
    assert recipe_from_megatron_config(_config(fp8="e4m3", fp8_recipe=name)) == expected


def test_megatron_str_enums_and_fp8_wgrad():
    from megatron.core.enums import Fp8Recipe

    got = recipe_from_megatron_config(_config(fp8="hybrid", fp8_recipe=Fp8Recipe.tensorwise, fp8_wgrad=False))
    assert got == R.Float8CurrentScaling(fp8_format=R.Format.HYBRID, backward_override="high_precision")


def test_fp4_nvfp4():
    assert recipe_from_megatron_config(_config(fp4="e2m1", fp4_recipe="nvfp4")) == R.NVFP4BlockScaling()


@pytest.mark.parametrize("fields, match", [
    ({"fp8": "e4m3", "fp8_recipe": "custom"}, "custom"),
    ({"fp4": "e2m1", "fp4_recipe": "custom"}, "custom"),
    ({"fp8": "e5m2"}, "fp8 format"),
    ({"fp8": "e4m3", "fp4": "e2m1"}, "both"),
    ({"fp8": "e4m3", "fp8_recipe": "rowwise"}, "unknown"),
])
def test_unsupported_fields_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        recipe_from_megatron_config(_config(**fields))


def test_resolve_recipe_option():
    config = _config(fp8="e4m3", fp8_recipe="mxfp8")
    assert resolve_recipe(None, config) == R.MXFP8BlockScaling(fp8_format=R.Format.E4M3)
    assert resolve_recipe("config", config) == R.MXFP8BlockScaling(fp8_format=R.Format.E4M3)
    assert resolve_recipe("none", config) is None  # the spec's choice wins over the config
    assert resolve_recipe("block", config) == R.Float8BlockScaling()
    mine = R.Float8CurrentScaling(use_power_2_scales=True)
    assert resolve_recipe(mine, config) is mine
    with pytest.raises(ValueError, match="unknown"):
        resolve_recipe("fp8", config)
    with pytest.raises(TypeError, match="Recipe"):
        resolve_recipe(3, config)


def test_importing_te_dist_megatron_does_not_import_megatron():
    """Only the spec/experts names load megatron-core; `import te_dist.megatron` stays cheap."""
    import subprocess
    import sys

    code = ("import sys, te_dist, te_dist.megatron as m; m.recipe_from_megatron_config; "
            "assert 'megatron' not in sys.modules, sorted(k for k in sys.modules if k.startswith('megatron'))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
