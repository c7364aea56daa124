"""Ready-made GPT MoE layer specs for Megatron's ``--spec <module> <attribute>`` option.

Why eager attributes: Megatron resolves ``--spec`` with ``vars(module)[attribute]`` and uses the
object as the transformer layer spec, so each attribute must already be a spec (importing this
module therefore imports megatron-core; nothing else in te_dist does that at import).

    --spec te_dist.megatron.layer_specs moe_layer          # recipe from the config's fp8/fp4 fields
    --spec te_dist.megatron.layer_specs moe_layer_block    # FP8 1x128/128x128 block scaling
    (also moe_layer_none, moe_layer_delayed, moe_layer_current, moe_layer_mxfp8, moe_layer_nvfp4)

Every layer built from one of these is an MoE layer (Megatron's ``--moe-layer-freq`` applies only
to its own decoder-block specs; use ``te_dist.megatron.gpt_decoder_block_spec`` in a custom
model provider for mixed dense/MoE stacks). Attention and norms are Megatron's local modules.
"""

from ..recipe import RECIPE_NAMES
from .specs import gpt_layer_spec

__all__ = ["moe_layer", *(f"moe_layer_{name}" for name in RECIPE_NAMES)]

moe_layer = gpt_layer_spec()
moe_layer_none = gpt_layer_spec("none")
moe_layer_delayed = gpt_layer_spec("delayed")
moe_layer_current = gpt_layer_spec("current")
moe_layer_block = gpt_layer_spec("block")
moe_layer_mxfp8 = gpt_layer_spec("mxfp8")
moe_layer_nvfp4 = gpt_layer_spec("nvfp4")
