"""Megatron-Core integration: te_dist grouped experts inside Megatron MoE model configs.

    from te_dist.megatron import experts_spec, with_te_dist_experts
    spec = with_te_dist_experts(get_gpt_decoder_block_spec(config, use_transformer_engine=False), recipe="block")

Only ``recipe_from_megatron_config``/``resolve_recipe`` work without megatron-core installed; the
other names import it on first use (``pip install 'te_dist[megatron]'``, 0.16.x or 0.19.x).
See docs/megatron.md.
"""

from ..lazy_import import lazy_getattr
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


# Lazy: `import te_dist.megatron` must not import megatron-core (heavy, optional).
__getattr__ = lazy_getattr(__name__, globals(), _LAZY)
