"""Megatron-Core integration: te_dist grouped experts inside Megatron MoE model configs.

    from te_dist.megatron import experts_spec, with_te_dist_experts
    spec = with_te_dist_experts(get_gpt_decoder_block_spec(config, use_transformer_engine=False), recipe="block")

Only ``recipe_from_megatron_config``/``resolve_recipe`` work without megatron-core installed; the
other names import it on first use (``pip install 'te_dist[megatron]'``, 0.16.x or 0.19.x).
See docs/megatron.md.
"""

import importlib

from .recipe_config import RECIPE_FROM_CONFIG, recipe_from_megatron_config, resolve_recipe

__all__ = [
    "RECIPE_FROM_CONFIG",
    "recipe_from_megatron_config",
    "resolve_recipe",
    "GroupedExperts",
    "experts_spec",
    "with_te_dist_experts",
    "gpt_layer_spec",
    "gpt_decoder_block_spec",
    "megatron_version",
]

_LAZY = {
    "GroupedExperts": ".experts",
    "experts_spec": ".specs",
    "with_te_dist_experts": ".specs",
    "gpt_layer_spec": ".specs",
    "gpt_decoder_block_spec": ".specs",
    "megatron_version": "._compat",
}


def __getattr__(name):
    # Lazy: `import te_dist.megatron` must not import megatron-core (heavy, optional).
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'te_dist.megatron' has no attribute {name!r}")
