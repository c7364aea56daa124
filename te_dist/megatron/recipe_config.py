"""Map Megatron-Core's fp8/fp4 config fields to te_dist recipes, and resolve a spec's recipe option.

Why a mapping of our own: Megatron turns ``--fp8-format``/``--fp8-recipe`` into TransformerEngine
recipes and refuses ``fp8`` on MoE configs without TransformerEngine. Configs that already carry
those fields should get the equivalent te_dist recipe; everything else names its recipe in the
spec (``experts_spec(recipe=...)``). Duck-typed: any object with the TransformerConfig field names
works, so this file never imports megatron.

    Megatron field                  te_dist
    fp8='e4m3' | 'hybrid'           fp8_format=Format.E4M3 | Format.HYBRID
    fp8_recipe='delayed'            DelayedScaling(margin=fp8_margin, amax_history_len=fp8_amax_history_len,
                                                   amax_compute_algo=fp8_amax_compute_algo)
    fp8_recipe='tensorwise'         Float8CurrentScaling
    fp8_recipe='blockwise'          Float8BlockScaling
    fp8_recipe='mxfp8'              MXFP8BlockScaling
    fp8_wgrad=False                 backward_override='high_precision' (dgrad AND wgrad unquantized)
    fp4='e2m1', fp4_recipe='nvfp4'  NVFP4BlockScaling()
    fp8_recipe / fp4_recipe 'custom' -> ValueError (a TransformerEngine quantizer factory)
"""

from __future__ import annotations

from typing import Optional

from .. import recipe as R

__all__ = ["RECIPE_FROM_CONFIG", "recipe_from_megatron_config", "resolve_recipe"]

RECIPE_FROM_CONFIG = "config"  # the spec option value meaning "use the config's fp8/fp4 fields"

_FP8_FORMATS = {"e4m3": R.Format.E4M3, "hybrid": R.Format.HYBRID}


def _enum_value(value):
    # Megatron passes both plain strings and its str-Enums (Fp8Recipe.delayed); compare by value.
    return getattr(value, "value", value)


def recipe_from_megatron_config(config) -> Optional[R.Recipe]:
    """The te_dist recipe equivalent to ``config``'s fp8/fp4 settings, or None when neither is set."""
    fp8 = _enum_value(getattr(config, "fp8", None))
    fp4 = _enum_value(getattr(config, "fp4", None))
    if fp8 and fp4:
        raise ValueError(f"config sets both {fp8=} and {fp4=}; Megatron allows only one")
    if fp4:
        return _fp4_recipe(config, fp4)
    if fp8:
        return _fp8_recipe(config, fp8)
    return None


def _fp8_recipe(config, fp8) -> R.Recipe:
    if fp8 not in _FP8_FORMATS:
        raise ValueError(f"config.fp8={fp8!r} is not a Megatron fp8 format; expected one of {sorted(_FP8_FORMATS)}")
    fmt = _FP8_FORMATS[fp8]
    name = _enum_value(getattr(config, "fp8_recipe", "delayed"))
    override = None if getattr(config, "fp8_wgrad", True) else "high_precision"
    if name == "delayed":
        return R.DelayedScaling(
            margin=int(getattr(config, "fp8_margin", 0)),
            fp8_format=fmt,
            amax_history_len=int(getattr(config, "fp8_amax_history_len", 1)),
            amax_compute_algo=_enum_value(getattr(config, "fp8_amax_compute_algo", "most_recent")),
            backward_override=override,
        )
    if name == "tensorwise":
        return R.Float8CurrentScaling(fp8_format=fmt, backward_override=override)
    if name == "blockwise":
        return R.Float8BlockScaling(fp8_format=fmt, backward_override=override)
    if name == "mxfp8":
        return R.MXFP8BlockScaling(fp8_format=fmt, backward_override=override)
    if name == "custom":
        raise ValueError(
            "config.fp8_recipe='custom' names a TransformerEngine quantizer factory, which te_dist cannot run; "
            "pass a te_dist recipe instead: experts_spec(recipe=...)"
        )
    raise ValueError(
        f"config.fp8_recipe={name!r} is unknown; expected one of 'delayed', 'tensorwise', 'blockwise', 'mxfp8'"
    )


def _fp4_recipe(config, fp4) -> R.Recipe:
    if fp4 != "e2m1":
        raise ValueError(f"config.fp4={fp4!r} is not a Megatron fp4 format; expected 'e2m1'")
    name = _enum_value(getattr(config, "fp4_recipe", "nvfp4"))
    if name == "nvfp4":
        return R.NVFP4BlockScaling()
    if name == "custom":
        raise ValueError(
            "config.fp4_recipe='custom' names a TransformerEngine quantizer factory, which te_dist cannot run; "
            "pass a te_dist recipe instead: experts_spec(recipe=...)"
        )
    raise ValueError(f"config.fp4_recipe={name!r} is unknown; expected 'nvfp4'")


def resolve_recipe(option, config) -> Optional[R.Recipe]:
    """Turn a spec's ``recipe`` option into a recipe (or None: no quantization).

    ``option`` is a ``te_dist.recipe.Recipe``, a recipe name (``"none"``, ``"delayed"``, ``"current"``,
    ``"block"``, ``"mxfp8"``, ``"nvfp4"``), or ``"config"`` (the default, also spelled None): the
    config's fp8/fp4 fields decide.
    """
    if option is None or option == RECIPE_FROM_CONFIG:
        return recipe_from_megatron_config(config)
    if isinstance(option, R.Recipe):
        return option
    if isinstance(option, str):
        if option not in R.RECIPE_NAMES:
            raise ValueError(
                f"experts recipe={option!r} is unknown; expected a te_dist Recipe, {RECIPE_FROM_CONFIG!r} "
                f"or one of {R.RECIPE_NAMES}"
            )
        return R.recipe_from_name(option)
    raise TypeError(
        f"experts recipe must be a te_dist.recipe.Recipe, a recipe name or None, got {type(option).__name__}"
    )
