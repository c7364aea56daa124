"""``GroupedExperts``: te_dist's grouped-GEMM expert MLP as a Megatron-Core experts module.

Why: Megatron users switch experts by changing a spec. This module has Megatron's experts
constructor and forward, and runs all local experts as one te_dist fused op sequence

    x_TH --GroupedLinear(fc1 [E, 2F, H])--> h_T2F --ScaledSwiGLU(probs_T)--> a_TF
         --GroupedLinear(fc2 [E, H, F])--> y_TH

Other activations (GeGLU, GELU, ReLU, ``glu_linear_offset``, ...) run Megatron's own activation
function between two te_dist grouped GEMMs (fc1 [E, 2F or F, H], fc2 [E, H, F]), scaled by the
probability and rounded to the activations' dtype exactly as ``MLP.forward`` does.

under the spec's recipe (``te_dist.autocast``), where Megatron's ``SequentialMLP`` loops over
experts. It computes the same function as ``SequentialMLP`` built from the same config: the
routing probability scales the SwiGLU output before fc2, and an fc2 bias is scaled by it too.

Legend: T tokens routed to this rank (sorted by local expert), H hidden size, F
``moe_ffn_hidden_size`` divided by the expert tensor-parallel size (ETP), E local experts.
With ETP > 1 each rank holds its part of every expert's ffn, as Megatron's expert linears do;
the token dispatcher gathers the tokens and reduce-scatters the outputs over the ETP group.
``config.gradient_accumulation_fusion`` sets the expert GEMMs' ``fuse_wgrad_accumulation`` while
``te_dist.settings.megatron_main_grad_fusion`` is on: the native FP8 wgrad adds into Megatron's ``main_grad`` itself
(``te_dist.ops.basic.wgrad_accumulation``).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from .. import settings
from ..autocast import get_active_recipe
from ..distributed.groups import group_rank, group_size
from ..moe.expert_mlp import build_expert_mlp
from ..moe.init import init_experts_, on_seeded_global_rng
from ..moe.padding import native_row_alignment, needs_padding, pad_expert_rows
from ..ops import OperationFuser
from ..ops.basic.wgrad_accumulation import set_fuse_wgrad_accumulation
from ._compat import define_missing_te_general_gemm, require_megatron
from .checkpoint import expert_tensor_factory
from .recipe_config import resolve_recipe
from .state_dict import install_megatron_layout_loading

require_megatron()
define_missing_te_general_gemm()  # the router of a TE-less 0.16 install needs it, whichever experts run

from megatron.core.transformer.module import MegatronModule  # noqa: E402  (after the version check)

__all__ = ["GroupedExperts"]


def _check_config(config, num_local_experts: int, ep_size: int, etp_size: int) -> None:
    """Reject what the grouped path does not compute the way SequentialMLP would, before allocating."""
    if not isinstance(num_local_experts, int) or num_local_experts < 1:
        raise ValueError(f"num_local_experts must be a positive int, got {num_local_experts!r}")
    if config.num_moe_experts != num_local_experts * ep_size:
        raise ValueError(
            f"config.num_moe_experts={config.num_moe_experts} != {num_local_experts=} * {ep_size=}"
        )
    if config.moe_ffn_hidden_size is None:
        raise ValueError("config.moe_ffn_hidden_size must be set for MoE experts, got None")
    if not callable(config.activation_func):
        raise TypeError(f"config.activation_func must be callable, got {config.activation_func!r}")
    if getattr(config, "moe_latent_size", None):
        raise ValueError(f"config.moe_latent_size must be None for te_dist experts, got {config.moe_latent_size}")
    if getattr(config, "delay_wgrad_compute", False):
        raise ValueError("config.delay_wgrad_compute=True is not supported by te_dist experts")
    if config.moe_ffn_hidden_size % etp_size:
        raise ValueError(
            f"config.moe_ffn_hidden_size={config.moe_ffn_hidden_size} is not divisible by the expert "
            f"tensor-parallel size {etp_size=}"
        )


def _fused_swiglu(config) -> bool:
    """The activation ScaledSwiGLU computes inside the fused op sequence."""
    return bool(config.gated_linear_unit) and config.activation_func is F.silu and not config.glu_linear_offset


def _megatron_activation(config):
    """Megatron's unfused expert activation (``MLP.forward``'s ``glu``), for every other config."""
    act, limit, offset = config.activation_func, config.activation_func_clamp_value, config.glu_linear_offset
    if not config.gated_linear_unit:
        return act

    def glu(h):
        gate, linear = torch.chunk(h, 2, dim=-1)
        if limit is not None:
            gate, linear = gate.clamp(min=None, max=limit), linear.clamp(min=-limit, max=limit)
        return act(gate) * (linear + offset)

    return glu


def _etp_part_init(init, full_shape: tuple, take):
    """An expert-slice init that draws the expert's whole tensor and keeps this ETP rank's ``take(full)``."""

    def part(param_slice, seed):
        full = torch.empty(full_shape, dtype=param_slice.dtype, device=param_slice.device)
        init(full, seed)
        param_slice.copy_(take(full))

    return part


# Routing-probability dtypes ScaledSwiGLU takes; Megatron's fp64 router (moe_router_dtype="fp64")
# gives float64, which is cast to float32: the product is rounded to the activations' dtype either way.
_PROBS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GroupedExperts(MegatronModule):
    """Megatron experts module: ``(permuted_tokens, tokens_per_expert, permuted_probs) -> (output, None)``.

    Constructor matches Megatron's experts builders of 0.16 (``build_module``) and 0.19 (called with
    ``name=``). Options come from the spec's params (see ``te_dist.megatron.experts_spec``).
    """

    def __init__(
        self,
        num_local_experts: int,
        config,
        pg_collection=None,
        name: Optional[str] = None,
        *,
        recipe=None,
        recipe_group: str = "ep",
        submodules=None,
    ):
        if submodules is not None:
            raise TypeError(
                "GroupedExperts takes no submodules (its ops are te_dist's); build it with "
                f"te_dist.megatron.experts_spec(), got submodules={submodules!r}"
            )
        if recipe_group not in ("ep", None):
            raise ValueError(f"recipe_group must be 'ep' or None, got {recipe_group!r}")
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        ep_group = pg_collection.ep
        ep_size, ep_rank = group_size(ep_group), group_rank(ep_group)
        etp_size, etp_rank = group_size(pg_collection.expt_tp), group_rank(pg_collection.expt_tp)
        _check_config(config, num_local_experts, ep_size, etp_size)
        resolved = resolve_recipe(recipe, config)  # raises before any allocation
        super().__init__(config=config)

        self.name = name
        self.num_local_experts = num_local_experts
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = ep_size, ep_rank
        # Expert tensor parallelism: this rank holds F / etp_size of every expert's ffn (fc1 rows
        # [gate_r; up_r], fc2 columns); the token dispatcher gathers and reduce-scatters over the group.
        self.etp_size, self.etp_rank = etp_size, etp_rank
        self.expt_dp_group = getattr(pg_collection, "expt_dp", None)
        self.recipe = resolved
        # An explicit "none" also overrides an outer te_dist.autocast; "config" without fp8/fp4 inherits it.
        self._recipe_disabled = isinstance(recipe, str) and recipe == "none"
        self._recipe_group = ep_group if (recipe_group == "ep" and ep_size > 1) else None

        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size // etp_size
        dtype = config.params_dtype
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        bias = bool(config.add_bias_linear)
        self.gated = config.gated_linear_unit
        fused = _fused_swiglu(config)
        # The expert MLP's one builder; for any activation but SwiGLU only its two grouped GEMMs are used.
        # activation_func_clamp_value clamps gate <= v and -v <= up <= v, as ScaledSwiGLU's limit does.
        fuser = build_expert_mlp(num_local_experts, hidden, ffn, activation="swiglu" if self.gated else "gelu",
                                 probs_in_expert=fused, fc1_bias=bias, fc2_bias=False,
                                 swiglu_limit=getattr(config, "activation_func_clamp_value", None) if fused else None,
                                 dtype=dtype, device=device)
        self.linear_fc1, activation, self.linear_fc2 = fuser.basic_ops
        if fused:
            self.activation = activation
        else:
            self.activation = None
            self._activation_func = _megatron_activation(config)
        # Megatron scales the fc2 bias by the routing probability (MLP.forward with per_token_scale),
        # which a bias inside the fused sequence (added after the scaled SwiGLU) would not: kept here.
        self.linear_fc2_bias = (
            torch.nn.Parameter(torch.zeros(num_local_experts, hidden, dtype=dtype, device=device)) if bias else None
        )
        # Not a registered child: the ops above already own the parameters under Megatron-like names.
        if self.activation is not None:
            self.__dict__["_fuser"] = fuser
        else:  # two grouped GEMMs around Megatron's activation
            self.__dict__["_fuser"] = None
            self.__dict__["_fc1_fuser"] = OperationFuser([self.linear_fc1])
            self.__dict__["_fc2_fuser"] = OperationFuser([self.linear_fc2])

        # Megatron's gradient_accumulation_fusion: the native FP8 wgrad adds into its DDP's main_grad itself
        set_fuse_wgrad_accumulation(self, bool(getattr(config, "gradient_accumulation_fusion", False))
                                    and settings.current().megatron_main_grad_fusion)
        if config.perform_initialization:
            self._initialize(config)
        # Megatron's marking of expert parameters (its expert linears'): with expert parallelism
        # ``allreduce = False``, so DDP reduces their gradients over the expert-data-parallel group and
        # the optimizer keeps them apart; without it they are ordinary parameters, as SequentialMLP's
        # are, so both build the same optimizer (and the same checkpoint keys).
        expert_parallel = ep_size > 1 or etp_size > 1
        for param in self.parameters():
            param.allreduce = not expert_parallel
        # load_state_dict also takes SequentialMLP's and TEGroupedMLP's per-expert keys (upcycling, conversions).
        install_megatron_layout_loading(self)

    @torch.no_grad()
    def _initialize(self, config) -> None:
        """Megatron's init methods, seeded per *global* expert (te_dist.moe.init, the MoELayer's
        scheme) so any EP or ETP size gives the same experts (with ETP, each expert's whole
        tensors are drawn and this rank keeps its part). The base seed is the generator's initial
        seed, not a draw: Megatron's ranks may have drawn different amounts before (pipeline stages)."""
        fc1_init = on_seeded_global_rng(config.init_method)
        fc2_init = on_seeded_global_rng(config.output_layer_init_method)
        if self.etp_size > 1:
            ffn, part = config.moe_ffn_hidden_size, config.moe_ffn_hidden_size // self.etp_size
            rows = slice(self.etp_rank * part, (self.etp_rank + 1) * part)
            up_rows = slice(ffn + rows.start, ffn + rows.stop)
            fc1_rows = 2 * ffn if self.gated else ffn
            fc1_init = _etp_part_init(
                fc1_init, (fc1_rows, config.hidden_size),
                (lambda w: torch.cat([w[rows], w[up_rows]])) if self.gated else (lambda w: w[rows]),
            )
            fc2_init = _etp_part_init(fc2_init, (config.hidden_size, ffn), lambda w: w[:, rows])
        init_experts_([(self.linear_fc1.weight, fc1_init), (None, None), (self.linear_fc2.weight, fc2_init)],
                      self.ep_rank * self.num_local_experts, torch.initial_seed())
        if getattr(self.linear_fc1, "bias", None) is not None:
            self.linear_fc1.bias.zero_()
        if self.linear_fc2_bias is not None:
            self.linear_fc2_bias.zero_()

    def _recipe_context(self):
        from ..autocast import autocast

        if self._recipe_disabled:
            return autocast(enabled=False)
        if self.recipe is None:
            return contextlib.nullcontext()  # an outer te_dist.autocast (if any) decides
        return autocast(recipe=self.recipe, group=self._recipe_group)

    def forward(self, permuted_tokens, tokens_per_expert, permuted_probs, **kwargs):
        """Run the local experts; ``tokens_per_expert`` [E] may live on the CPU or on the tokens' device.

        Megatron 0.19 may pass ``routing_map`` (inference; ignored) and zero-copy buffers (only with
        its NCCL-EP dispatcher, which these experts do not support).
        """
        unsupported = sorted(k for k, v in kwargs.items() if v is not None and k != "routing_map")
        if unsupported:
            raise TypeError(f"GroupedExperts.forward does not support {unsupported}; use another token dispatcher")
        x_TH, probs_T = permuted_tokens, permuted_probs
        if x_TH.dim() != 2 or x_TH.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"permuted_tokens must be [tokens, {self.config.hidden_size}], got {tuple(x_TH.shape)}"
            )
        if tuple(tokens_per_expert.shape) != (self.num_local_experts,):
            raise ValueError(
                f"tokens_per_expert must have shape ({self.num_local_experts},), got {tuple(tokens_per_expert.shape)}"
            )
        if tuple(probs_T.shape) != (x_TH.shape[0],):
            raise ValueError(f"permuted_probs must have shape ({x_TH.shape[0]},), got {tuple(probs_T.shape)}")
        if not probs_T.is_floating_point():
            raise TypeError(f"permuted_probs must be a floating-point tensor, got {probs_T.dtype}")
        if tokens_per_expert.device.type == "cpu":  # free to check here; on a GPU it would sync
            total = int(tokens_per_expert.sum())
            if total != x_TH.shape[0]:
                raise ValueError(f"tokens_per_expert sums to {total}, but permuted_tokens has {x_TH.shape[0]} rows")

        if self.config.moe_apply_probs_on_input:
            x_TH = (probs_T.unsqueeze(-1) * x_TH).to(x_TH.dtype)
            probs_T = torch.ones_like(probs_T)
        split_sizes = tokens_per_expert.to(torch.int64)
        self._run_weight_owner_pre_hooks()
        with self._recipe_context():
            padded = self._pad_rows(x_TH, probs_T, split_sizes)
            x_PH, probs_P, splits = x_TH, probs_T, split_sizes
            if padded is not None:
                x_PH, probs_P, splits = padded.x_PH, padded.probs_P, padded.splits
            if self._fuser is not None:
                fused_probs_P = probs_P if probs_P.dtype in _PROBS_DTYPES else probs_P.to(torch.float32)
                y_TH = self._fuser(x_PH, splits, fused_probs_P, splits)
            else:
                h_PF = self._fc1_fuser(x_PH, splits)
                a_PF = (self._activation_func(h_PF) * probs_P.unsqueeze(-1)).to(h_PF.dtype)
                y_TH = self._fc2_fuser(a_PF, splits)
            if padded is not None:
                y_TH = padded.unpad(y_TH)
        if self.linear_fc2_bias is not None:
            expert_T = torch.repeat_interleave(
                torch.arange(self.num_local_experts, device=x_TH.device),
                split_sizes.to(x_TH.device),
                output_size=x_TH.shape[0],  # known length: no device-to-host sync
            )
            y_TH = y_TH + (probs_T.unsqueeze(-1) * self.linear_fc2_bias[expert_T]).to(y_TH.dtype)
        return y_TH, None

    def _native_row_alignment(self, x_TH: torch.Tensor) -> Optional[int]:
        """The row multiple the active recipe's native path needs of each expert's rows (None: none)."""
        return native_row_alignment(x_TH, get_active_recipe(), (self.linear_fc1, self.linear_fc2))

    def _pad_rows(self, x_TH, probs_T, split_sizes):
        """Each expert's rows padded with zero rows to the native FP8 path's row multiple, or None.

        Why: Megatron's token dispatchers hand over the rows unpadded, and the native FP8 grouped GEMMs
        quantize wgrad's operands along the rows in blocks (128 rows for block scaling, 16 for per-tensor),
        so an expert's rows must start on that multiple; off it the recipe runs the emulated path. MoELayer
        pads the same way (te_dist.moe.padding). The sizes are read on the host: from a device
        ``tokens_per_expert`` that is a sync, taken only where the padding may apply.
        Behind ``te_dist.settings.megatron_row_padding`` (on by default: docs/settings.md)."""
        if not settings.current().megatron_row_padding:
            return None
        alignment = self._native_row_alignment(x_TH)
        if alignment is None:
            return None
        sizes = split_sizes.tolist()
        if not needs_padding(sizes, alignment):
            return None
        return pad_expert_rows(x_TH, probs_T, sizes, alignment)

    def _run_weight_owner_pre_hooks(self) -> None:
        """Run the forward pre-hooks registered on the ops that own the expert weights.

        Why: Megatron's DDP with ``overlap_param_gather`` waits for a parameter's all-gather (the
        distributed optimizer's new values) in a forward pre-hook of the module owning it. The grouped
        linear ops own our weights but run inside the fuser, never called as modules themselves, so
        without this their weights would be read before the gather lands (last step's values).
        """
        for op in (self.linear_fc1, self.linear_fc2):
            with_kwargs = op._forward_pre_hooks_with_kwargs
            for hook_id, hook in tuple(op._forward_pre_hooks.items()):
                if hook_id in with_kwargs:
                    hook(op, (), {})
                else:
                    hook(op, ())

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass (no delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """SequentialMLP's checkpoint layout (see ``te_dist.megatron.checkpoint``)."""
        common = dict(sharded_offsets=sharded_offsets, ep_rank=self.ep_rank, ep_size=self.ep_size,
                      dp_rank=group_rank(self.expt_dp_group), tp_rank=self.etp_rank, tp_size=self.etp_size,
                      singleton=bool((metadata or {}).get("singleton_local_shards", False)))
        # The parameters themselves, not detached copies: Megatron's optimizers find each parameter's
        # entry by the tensor (their state is written under the same layout).
        tensors = (  # (our state-dict name, checkpoint name, tensor, gated halves, ETP axis, linear owning _extra_state)
            ("linear_fc1.weight", "linear_fc1.weight", self.linear_fc1.weight, self.gated, 0, "linear_fc1"),
            ("linear_fc1.bias", "linear_fc1.bias", getattr(self.linear_fc1, "bias", None), self.gated, 0, None),
            ("linear_fc2.weight", "linear_fc2.weight", self.linear_fc2.weight, False, 1, "linear_fc2"),
            ("linear_fc2_bias", "linear_fc2.bias", self.linear_fc2_bias, False, None, None),
        )
        sharded = {}
        for local_name, ckpt_name, tensor, glu, tp_axis, extra_owner in tensors:
            if tensor is None:
                continue
            sharded[f"{prefix}{local_name}"] = expert_tensor_factory(
                prefix, ckpt_name, tensor, glu=glu, tp_axis=tp_axis, extra_state_owner=extra_owner, **common
            )
        return sharded
