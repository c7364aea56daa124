"""``MoELayer``: router → permute → all-to-all dispatch → grouped expert MLP → combine.

Legend: T tokens, H hidden, F expert FFN size, E global experts, K top-k, R EP size,
El = E / R local experts, N rows this rank's experts receive.

    hidden_TH ─router─▶ probs_TK, indices_TK
              ─dispatcher.dispatch─▶ x_NH (rows by local expert), split_sizes_El, probs_N
              (each expert's rows on a block boundary, when the active FP8 recipe's native
               grouped path needs it: the dispatcher's last row gather writes them padded, or
               pad_expert_rows pads them here; the padding rows are dropped again at combine;
               at EP size 1 that gather is left to the experts: fc1 reads its rows from x_TH and,
               with the probabilities in the expert, fc2 returns out_TH, the combine done)
              (transport: "all_to_all" over ep_group, or "peer" memory on the GPUs of one host;
               "auto" picks peer where every rank can run it)
              ─OperationFuser[GroupedLinear(El,H,2F) → ScaledSwiGLU → GroupedLinear(El,F,H)]─▶ y_NH
              ─dispatcher.combine─▶ out_TH

Where the routing probability is applied (``probs_position``):
  * ``"expert"`` (default for SwiGLU, as Megatron-Core does): inside the MLP, after the
    activation and before the second GEMM (``fuser(x, splits, probs, splits)``). Biases of fc2
    are then *not* scaled by the probability.
  * ``"combine"``: the MLP runs unscaled and each expert output is weighted while summing the K
    outputs of a token (the only choice for non-gated activations, which have no scaled op).

The EP group agrees on the layer's shape, options and recipe at the first forward, and re-checks
them every step through a tag in the count exchange (te_dist.distributed.layer_agreement): ranks
that differ raise one LayerMismatchError together instead of crashing inside the transport.

Experts are sharded contiguously over ``ep_group``: EP rank r owns global experts
``[r*El, (r+1)*El)``. Expert parameters carry ``allreduce = False`` (the Megatron-Core marker),
so data-parallel wrappers reduce them over the expert-data-parallel group, not the full DP group.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from .. import settings
from ..autocast import get_active_recipe, get_recipe_key
from ..distributed.groups import group_rank, group_size
from ..distributed.layer_agreement import LayerAgreement
from ..ops.basic.weight_copy import check_microbatch_flag
from .expert_mlp import ACTIVATIONS, build_expert_mlp
from .init import draw_base_seed, init_experts_, uniform_fan_in
from .padding import native_row_alignment, needs_padding, pad_expert_rows
from .router import TopKRouter
from .state_dict import install_expert_state_dict_hooks
from .transports import TransportSelector
from .transports.selector import check_transport

__all__ = ["MoELayer"]

_PROBS_POSITIONS = ("expert", "combine")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_int(name, value, minimum=1):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {name}={value}")


class MoELayer(nn.Module):
    """Dropless top-k mixture of experts with expert parallelism over ``ep_group``.

    ``layer(hidden_states)`` takes ``[..., hidden_size]`` and returns the same shape. Router
    options (``score_function``, ``pre_softmax``, ``normalize``, ``expert_bias``,
    ``aux_loss_coeff``, ``z_loss_coeff``) are passed to :class:`TopKRouter`. ``transport``:
    how tokens move between EP ranks, ``"auto"`` | ``"all_to_all"`` | ``"peer"`` (docs/moe.md
    "Transports"); ``te_dist.settings.ep_transport`` overrides it where set. A forced transport that
    cannot run raises at the first forward, on every rank, with the reasons.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        ep_group=None,
        activation: str = "swiglu",
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        device=None,
        transport: str = "auto",
        probs_position: Optional[str] = None,
        swiglu_limit: Optional[float] = None,
        edp_group=None,
        **router_options,
    ):
        super().__init__()
        _check_int("hidden_size", hidden_size)
        _check_int("ffn_hidden_size", ffn_hidden_size)
        _check_int("num_experts", num_experts)
        _check_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"{top_k=} is larger than {num_experts=}")
        ep_size = group_size(ep_group)
        if num_experts % ep_size != 0:
            raise ValueError(f"{num_experts=} is not divisible by {ep_size=}")
        check_transport(transport)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        gated = activation == "swiglu"
        if probs_position is None:
            probs_position = "expert" if gated else "combine"
        if probs_position not in _PROBS_POSITIONS:
            raise ValueError(f"probs_position must be one of {_PROBS_POSITIONS}, got {probs_position!r}")
        if probs_position == "expert" and not gated:
            raise ValueError(f"probs_position='expert' needs activation='swiglu' (a scaled op), got {activation=!r}")
        if swiglu_limit is not None and not gated:
            raise ValueError(f"swiglu_limit applies to activation='swiglu', got {activation=!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be one of {_DTYPES} (the grouped-GEMM dtypes), got {dtype!r}")

        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.activation = activation
        self.probs_position = probs_position
        self.dtype = dtype
        self.ep_group = ep_group
        self.edp_group = edp_group
        self.ep_size = ep_size
        self.ep_rank = group_rank(ep_group)
        self.num_local_experts = num_experts // ep_size
        self.first_expert = self.ep_rank * self.num_local_experts

        # Global RNG use is identical at every EP size: one seed draw, then the router weight.
        base_seed = draw_base_seed()
        self.router = TopKRouter(hidden_size, num_experts, top_k, dtype=dtype, device=device, **router_options)
        self.transport = transport
        self.dispatcher = TransportSelector(num_experts, ep_group, transport)
        self.mlp = build_expert_mlp(self.num_local_experts, hidden_size, ffn_hidden_size, activation=activation,
                                    probs_in_expert=probs_position == "expert", fc1_bias=bias, fc2_bias=bias,
                                    swiglu_limit=swiglu_limit, dtype=dtype, device=device)
        self._init_experts(base_seed)
        for op in (self.fc1, self.fc2):
            for p in op.parameters():
                p.allreduce = False  # Megatron-Core: reduce over the expert-data-parallel group
        name_of = {id(p): n for n, p in self.named_parameters()}
        slots = {
            f"{fc}.{kind}": name_of[id(getattr(op, kind))]
            for fc, op in (("fc1", self.fc1), ("fc2", self.fc2))
            for kind in ("weight", "bias")
            if getattr(op, kind, None) is not None
        }
        install_expert_state_dict_hooks(self, slots, self.first_expert, num_experts)
        router = self.router  # what every EP rank must share (checked at the first forward, not here)
        self._agreement = LayerAgreement("MoELayer", dict(
            num_experts=num_experts, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, top_k=top_k,
            activation=activation, dtype=dtype, probs_position=probs_position, bias=bias, swiglu_limit=swiglu_limit,
            score_function=router.score_function, pre_softmax=router.pre_softmax, normalize=router.normalize,
            expert_bias=router.expert_bias is not None,
        ), ep_group)
        # Statistics of the last forward (for balancing updates and logs), on the input's device:
        self.tokens_per_expert = None  # int64 [E]: this rank's tokens routed to each global expert
        self.tokens_per_local_expert = None  # int64 [El]: rows this rank's experts received
        self.aux_loss = self.z_loss = None  # coefficient-weighted, detached (None when off)

    # ------------------------------------------------------------------ construction
    @property
    def fc1(self):
        return self.mlp.basic_ops[0]

    @property
    def fc2(self):
        return self.mlp.basic_ops[2]

    def _init_experts(self, base_seed: int) -> None:
        fc1_init, fc2_init = uniform_fan_in(self.hidden_size), uniform_fan_in(self.ffn_hidden_size)
        init_experts_([(self.fc1.weight, fc1_init), (getattr(self.fc1, "bias", None), fc1_init),
                       (self.fc2.weight, fc2_init), (getattr(self.fc2, "bias", None), fc2_init)],
                      self.first_expert, base_seed)

    def expert_parameters(self):
        """Parameters sharded over EP (reduce their gradients over the expert-data-parallel group)."""
        return [p for op in (self.fc1, self.fc2) for p in op.parameters()]

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, num_experts={self.num_experts}, "
            f"top_k={self.top_k}, ep_size={self.ep_size}, ep_rank={self.ep_rank}, activation={self.activation!r}, "
            f"probs_position={self.probs_position!r}, transport={self.transport!r}, dtype={self.dtype}"
        )

    # ------------------------------------------------------------------ forward
    def _check_input(self, hidden_states):
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"MoELayer input must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoELayer expects hidden states [..., {self.hidden_size}], got shape {tuple(hidden_states.shape)}"
            )
        if hidden_states.dtype != self.dtype:
            raise TypeError(f"MoELayer was built for dtype={self.dtype}, got input dtype={hidden_states.dtype}")
        weight = self.fc1.weight
        if hidden_states.device != weight.device:
            raise ValueError(f"MoELayer parameters are on {weight.device}, got input on {hidden_states.device}")

    def _prepare_expert_weights(self, recipe) -> None:
        """Queue both expert GEMMs' weight casts for this forward (GroupedLinear.prepare_weight), under the
        recipe state the fuser would give the ops (built here if the recipe changed since their last forward)."""
        key = get_recipe_key()
        for linear in (self.fc1, self.fc2):
            linear.ensure_recipe_state(recipe, key)
            linear.prepare_weight()

    def _native_row_alignment(self, x_TH: torch.Tensor, recipe) -> Optional[int]:
        """The row multiple the experts' rows must start on for ``recipe``'s native path (None: none)."""
        return native_row_alignment(x_TH, recipe, (self.fc1, self.fc2))

    @property
    def is_first_microbatch(self) -> Optional[bool]:
        """The experts' weight-copy setting (TransformerEngine's protocol, te_dist.ops.basic.weight_copy):
        None (default) casts the FP8 weights at every forward; True casts and keeps them for the later
        micro-batches of the optimizer step, then turns False; False reuses the kept copies while they
        are valid. Megatron-Core's ``set_is_first_microbatch`` sets it like any module's."""
        return self.fc1.is_first_microbatch

    @is_first_microbatch.setter
    def is_first_microbatch(self, value: Optional[bool]) -> None:
        self.fc1.is_first_microbatch = self.fc2.is_first_microbatch = check_microbatch_flag(value)

    def forward(self, hidden_states: torch.Tensor, *, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """``is_first_microbatch``: True / False set :attr:`is_first_microbatch` for this forward on; None
        leaves it as it is."""
        if is_first_microbatch is not None:
            self.is_first_microbatch = is_first_microbatch
        self._check_input(hidden_states)
        recipe = get_active_recipe()
        tag = None
        if self._agreement.active:  # the first forward agrees over the EP group
            tag = self._agreement.check(hidden_states.device, recipe, None if recipe is None else get_recipe_key())
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, self.hidden_size)
        routing = self.router(x_TH, check_finite=False)
        # Non-finite logits (NaN or inf) travel in-band with the count exchange so every EP rank raises together.
        invalid = ~torch.isfinite(routing.logits_TE).all()
        probs_in_expert = self.probs_position == "expert"
        alignment = self._native_row_alignment(x_TH, recipe)
        # With the native FP8 path at EP size 1 the experts take the expand gather: fc1 reads its rows from
        # x_TH, and (probabilities in the expert) fc2 sums its rows back, the combine; under per-tensor
        # recipes both then gather FP8 bytes (te_dist.ops.RowGather). x_NH is x_TH then. Off
        # (te_dist.settings.gather_in_experts): the dispatcher copies the rows, the reference path.
        gather_in_experts = alignment is not None and settings.current().gather_in_experts
        # The experts' weight casts need no counts: queued while the counts travel to the host, the GPU runs
        # them while the host waits and reads (te_dist.settings.early_weight_casts; docs/moe.md "The host read").
        during_read = None
        if alignment is not None and settings.current().early_weight_casts:
            during_read = functools.partial(self._prepare_expert_weights, recipe)
        x_NH, split_sizes_El, probs_N, state = self.dispatcher.dispatch(
            x_TH, routing.probs_TK, routing.indices_TK, probs_in_expert=probs_in_expert, invalid=invalid, tag=tag,
            row_alignment=alignment, gather_in_experts=gather_in_experts, during_read=during_read,
        )
        self._agreement.verify(state.peer_tags)  # every rank's tag: a change on some ranks raises on all
        # The experts get the split both ways: the offsets the dispatcher queued on the device before
        # its host read, and the sizes that read brought. The GEMM backend sees the actual group sizes
        # (and may run cuBLAS per expert) with no device read and no host→device copy: between the
        # read and the first GEMM the GPU waits for the host (docs/moe.md "The host read").
        splits = state.group_splits()
        fc2_splits = splits
        if splits.rows_in is not None:  # fc1 reads them from x_TH; fc2 sums its rows back (the combine) if it can
            fc2_splits = splits._replace(rows_in=None, rows_out=splits.rows_in if probs_in_expert else None)
        padded = None
        if needs_padding(splits.sizes, alignment):  # the dispatcher did not pad them: pad on their own
            padded = pad_expert_rows(x_NH, probs_N if probs_in_expert else None, splits.sizes, alignment)
            x_NH, probs_N, splits = padded.x_PH, padded.probs_P, padded.splits
            fc2_splits = splits
        if probs_in_expert:
            y_NH = self.mlp(x_NH, splits, probs_N, fc2_splits)
        else:
            y_NH = self.mlp(x_NH, splits, fc2_splits)
        if padded is not None:
            y_NH = padded.unpad(y_NH)
        # Statistics only: set after the MLP is queued, for the same reason (nn.Module attributes are slow).
        self.tokens_per_expert = state.permutation.counts_E
        self.tokens_per_local_expert = split_sizes_El
        self.aux_loss, self.z_loss = routing.aux_loss, routing.z_loss
        out_TH = y_NH if fc2_splits.rows_out is not None else self.dispatcher.combine(y_NH, state)
        return out_TH.reshape(shape)
