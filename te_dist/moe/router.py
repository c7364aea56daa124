"""Top-k router: a linear gate, a score function, top-k selection and the auxiliary losses.

Legend: T tokens, H hidden, E experts (global), K top-k.

Score functions (dropless: every token gets exactly K experts, no capacity):
  * ``softmax`` post-top-k (default): top-k over logits, softmax over the K chosen logits.
  * ``softmax`` pre-top-k (``pre_softmax=True``): softmax over all E, then top-k of the scores.
  * ``sigmoid`` (DeepSeek-V3): sigmoid scores; with ``expert_bias=True`` a per-expert bias buffer
    is added for *selection only*, the weights stay the unbiased scores. The bias is trained by
    the caller's load-balancing update (``update_expert_bias``), not by gradients.
``normalize=True`` rescales the K probabilities of each token to sum to one.

The router computes in fp32 (fp64 for fp64 layers) whatever the activation dtype: routing decisions are discontinuous,
so bf16 logits would make EP sizes (different reduction orders) pick different experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TopKRouter", "RoutingResult", "load_balancing_loss", "z_loss", "attach_aux_loss"]

_SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass
class RoutingResult:
    """What the dispatcher needs: [T, K] probabilities (router dtype) and int64 global expert indices."""

    probs_TK: torch.Tensor
    indices_TK: torch.Tensor
    logits_TE: torch.Tensor
    aux_loss: Optional[torch.Tensor] = None  # coefficient-weighted, detached copy for logging
    z_loss: Optional[torch.Tensor] = None


def load_balancing_loss(scores_TE: torch.Tensor, indices_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer loss ``E * sum_e f_e * P_e`` (1.0 when perfectly balanced).

    ``f_e``: fraction of the T*K assignments that went to expert e (no gradient);
    ``P_e``: mean routing score of expert e over tokens (scores normalised per token).
    """
    num_tokens, top_k = indices_TK.shape
    if num_tokens == 0:
        return scores_TE.sum() * 0.0
    flat = indices_TK.reshape(-1)
    # scatter_add, not bincount: bincount reads its max back to the host (a GPU sync)
    counts_E = torch.zeros(num_experts, dtype=scores_TE.dtype, device=flat.device).scatter_add_(
        0, flat, torch.ones(flat.shape, dtype=scores_TE.dtype, device=flat.device)
    )
    fraction_E = counts_E / (num_tokens * top_k)
    mean_score_E = scores_TE.mean(dim=0)
    return num_experts * torch.sum(fraction_E * mean_score_E)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2`` (keeps logits small)."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also sends gradient 1 into ``loss``.

    Why: the auxiliary losses then train the gate without every caller adding them to its loss
    (Megatron-Core does the same); the loss value stays readable for logging.
    """

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_shape = loss.shape
        ctx.loss_dtype = loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        return grad_x, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad_x.device)


def attach_aux_loss(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """Return ``x`` unchanged; its backward adds ``d loss`` to the graph that produced ``loss``."""
    if not loss.requires_grad:
        return x
    return _AttachAuxLoss.apply(x, loss)


class TopKRouter(nn.Module):
    """Linear gate [E, H] + score function + top-k. Returns a :class:`RoutingResult`."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_function: str = "softmax",
        pre_softmax: bool = False,
        normalize: Optional[bool] = None,
        expert_bias: bool = False,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        dtype=None,
        device=None,
    ):
        super().__init__()
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an int in [1, num_experts], got {top_k=} with {num_experts=}")
        if score_function not in _SCORE_FUNCTIONS:
            raise ValueError(f"score_function must be one of {_SCORE_FUNCTIONS}, got {score_function!r}")
        if pre_softmax and score_function != "softmax":
            raise ValueError(f"pre_softmax=True applies to score_function='softmax', got {score_function!r}")
        if expert_bias and score_function != "sigmoid":
            raise ValueError(f"expert_bias=True applies to score_function='sigmoid', got {score_function!r}")
        if aux_loss_coeff < 0 or z_loss_coeff < 0:
            raise ValueError(f"loss coefficients must be >= 0, got {aux_loss_coeff=} {z_loss_coeff=}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_function = score_function
        self.pre_softmax = pre_softmax
        # Post-top-k softmax is normalised by construction; sigmoid (DeepSeek-V3) normalises by default.
        self.normalize = (score_function == "sigmoid" and top_k > 1) if normalize is None else bool(normalize)
        self.aux_loss_coeff = float(aux_loss_coeff)
        self.z_loss_coeff = float(z_loss_coeff)
        # Router weight in fp32 at least (see module docstring); same init as nn.Linear.
        param_dtype = torch.promote_types(dtype or torch.float32, torch.float32)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=param_dtype, device=device))
        bound = 1.0 / math.sqrt(hidden_size)
        nn.init.uniform_(self.weight, -bound, bound)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=param_dtype, device=device))
        else:
            self.expert_bias = None

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_function={self.score_function!r}, pre_softmax={self.pre_softmax}, normalize={self.normalize}, "
            f"expert_bias={self.expert_bias is not None}, aux_loss_coeff={self.aux_loss_coeff}, "
            f"z_loss_coeff={self.z_loss_coeff}"
        )

    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        return F.linear(x_TH.to(self.weight.dtype), self.weight)

    def select(self, logits_TE: torch.Tensor):
        """(probs_TK, indices_TK int64, scores_TE used by the balancing loss)."""
        k = self.top_k
        if self.score_function == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
            selection_TE = scores_TE if self.expert_bias is None else scores_TE + self.expert_bias
            _, indices_TK = torch.topk(selection_TE, k, dim=-1)
            probs_TK = scores_TE.gather(-1, indices_TK)
            balance_TE = scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
        elif self.pre_softmax:
            scores_TE = torch.softmax(logits_TE, dim=-1)
            probs_TK, indices_TK = torch.topk(scores_TE, k, dim=-1)
            balance_TE = scores_TE
        else:
            top_logits_TK, indices_TK = torch.topk(logits_TE, k, dim=-1)
            probs_TK = torch.softmax(top_logits_TK, dim=-1)
            balance_TE = torch.softmax(logits_TE, dim=-1)
        if self.normalize:
            probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return probs_TK, indices_TK, balance_TE

    def forward(self, x_TH: torch.Tensor, *, check_finite: bool = True) -> RoutingResult:
        """``check_finite=False``: the caller checks the logits itself (MoELayer agrees on it across EP ranks)."""
        logits_TE = self.logits(x_TH)
        # inf is as bad as NaN: top-k still picks experts, then the softmax turns inf into NaN.
        if check_finite and not torch.isfinite(logits_TE).all():
            raise ValueError("router logits contain NaN or inf (check the input hidden states and the router weight)")
        probs_TK, indices_TK, balance_TE = self.select(logits_TE)
        aux = zl = None
        if self.training and torch.is_grad_enabled():
            if self.aux_loss_coeff > 0:
                loss = self.aux_loss_coeff * load_balancing_loss(balance_TE, indices_TK, self.num_experts)
                probs_TK = attach_aux_loss(probs_TK, loss)
                aux = loss.detach()
            if self.z_loss_coeff > 0:
                loss = self.z_loss_coeff * z_loss(logits_TE)
                probs_TK = attach_aux_loss(probs_TK, loss)
                zl = loss.detach()
        return RoutingResult(probs_TK, indices_TK, logits_TE, aux, zl)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_E: torch.Tensor, rate: float = 1e-3) -> None:
        """DeepSeek-V3 aux-loss-free balancing: raise the bias of under-loaded experts by ``rate``."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs a router built with expert_bias=True")
        if tokens_per_expert_E.shape != (self.num_experts,):
            raise ValueError(f"tokens_per_expert must have shape ({self.num_experts},), got {tuple(tokens_per_expert_E.shape)}")
        load = tokens_per_expert_E.to(self.expert_bias.device, self.expert_bias.dtype)
        self.expert_bias += rate * torch.sign(load.mean() - load)
