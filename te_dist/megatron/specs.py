"""Spec helpers: put te_dist experts into Megatron-Core MoE, GPT layer and decoder-block specs.

Why a walker rather than a copy of Megatron's spec functions: Megatron builds its specs
differently in 0.16 (``ModuleSpec(module=MoELayer, submodules=MoESubmodules(...))``) and 0.19
(``functools.partial(MoELayer, submodules=MoESubmodules(...))``), and users bring their own specs.
``with_te_dist_experts`` finds every ``MoESubmodules`` inside whatever it is given and returns a
copy whose ``experts`` is ours; the input spec is never mutated (Megatron shares spec objects
between layers and models).
"""

from __future__ import annotations

import dataclasses
import functools

from ._compat import require_megatron
from .experts import GroupedExperts
from .recipe_config import RECIPE_FROM_CONFIG

require_megatron()

from megatron.core.transformer.moe.moe_layer import MoESubmodules  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402

__all__ = ["experts_spec", "with_te_dist_experts", "gpt_layer_spec", "gpt_decoder_block_spec"]

_OPTIONS = ("recipe_group",)


def experts_spec(recipe=None, **options) -> ModuleSpec:
    """``MoESubmodules(experts=experts_spec(recipe=...))``: te_dist grouped experts.

    ``recipe``: a ``te_dist.recipe.Recipe``, a recipe name (``"none"``, ``"delayed"``, ``"current"``,
    ``"block"``, ``"mxfp8"``, ``"nvfp4"``), or ``"config"``/None (default): map the Megatron config's
    fp8/fp4 fields (``te_dist.megatron.recipe_from_megatron_config``); a config without them runs
    unquantized unless an outer ``te_dist.autocast`` is active. ``"none"`` always runs unquantized.
    ``recipe_group``: ``"ep"`` (default) makes the expert-parallel ranks agree on the recipe
    string; None skips that check.
    """
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"experts_spec got unknown options {unknown}; expected 'recipe' or one of {list(_OPTIONS)}")
    params = {"recipe": RECIPE_FROM_CONFIG if recipe is None else recipe, **options}
    # ModuleSpec is what both releases accept: 0.16 passes it to build_module, 0.19 calls it.
    return ModuleSpec(module=GroupedExperts, params=params)


def _replace_experts(obj, experts):
    """A copy of ``obj`` with every MoESubmodules' experts replaced; (new_obj, number replaced)."""
    if isinstance(obj, MoESubmodules):
        return dataclasses.replace(obj, experts=experts), 1
    if isinstance(obj, ModuleSpec):
        new_sub, count = _replace_experts(obj.submodules, experts)
        return (dataclasses.replace(obj, submodules=new_sub), count) if count else (obj, 0)
    if isinstance(obj, functools.partial):
        count = 0
        keywords = dict(obj.keywords)
        for key, value in obj.keywords.items():
            keywords[key], found = _replace_experts(value, experts)
            count += found
        return (functools.partial(obj.func, *obj.args, **keywords), count) if count else (obj, 0)
    if isinstance(obj, (list, tuple)):
        items, count = [], 0
        for item in obj:
            new_item, found = _replace_experts(item, experts)
            items.append(new_item)
            count += found
        return (type(obj)(items), count) if count else (obj, 0)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # TransformerLayerSubmodules, TransformerBlockSubmodules, ...: walk their fields.
        changes, count = {}, 0
        for field in dataclasses.fields(obj):
            if not field.init:
                continue
            value = getattr(obj, field.name)
            new_value, found = _replace_experts(value, experts)
            if found:
                changes[field.name] = new_value
                count += found
        return (dataclasses.replace(obj, **changes), count) if count else (obj, 0)
    return obj, 0


def with_te_dist_experts(spec, recipe=None, **options):
    """Return a copy of a Megatron MoE/layer/block spec whose MoE experts are te_dist's.

    Accepts a ``ModuleSpec``, a ``functools.partial`` (0.19 MoE specs), ``TransformerBlockSubmodules``
    or a list of layer specs. Raises ValueError when the spec contains no MoE layer.
    """
    new_spec, count = _replace_experts(spec, experts_spec(recipe, **options))
    if count == 0:
        raise ValueError(
            f"no MoESubmodules found in the spec of type {type(spec).__name__}; "
            "build it with num_experts set (e.g. get_gpt_layer_local_spec(num_experts=...))"
        )
    return new_spec


def gpt_layer_spec(recipe=None, *, normalization=None, qk_layernorm=False, **options) -> ModuleSpec:
    """Megatron's local (no TransformerEngine) GPT MoE layer spec, with te_dist experts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # num_experts only selects the MoE MLP here; the expert count comes from the config.
    base = get_gpt_layer_local_spec(num_experts=1, normalization=normalization, qk_layernorm=qk_layernorm)
    return with_te_dist_experts(base, recipe, **options)


def gpt_decoder_block_spec(config, *, use_transformer_engine=False, recipe=None, **options):
    """Megatron's GPT decoder-block spec for ``config`` (dense and MoE layers), with te_dist experts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    kwargs = {}
    normalization = getattr(config, "normalization", None)
    if normalization is not None:
        kwargs["normalization"] = normalization
    base = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine, **kwargs)
    return with_te_dist_experts(base, recipe, **options)
