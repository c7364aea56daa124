"""``AdamWWithFP8Copies``: ``torch.optim.AdamW`` whose update of an expert weight also writes its FP8 copy.

Why: under an FP8 recipe every optimizer step is followed by a cast of every expert weight (read the bf16 weight
again, write FP8 in both GEMM layouts). Written in the same pass as the update, the copy costs its writes alone
(:mod:`te_dist.quantization.triton_adamw_copy`), and the next forward casts nothing.

Which weights: those of the ``GroupedLinear`` ops in ``copies_of`` that say so
(``GroupedLinear.optimizer_copy_quantizer``: DelayedScaling, Float8CurrentScaling or 128x128 block scaling on the
native path, under a caller driving ``is_first_microbatch``; :mod:`te_dist.quantization.optimizer_copy` says which),
on a CUDA device with the Triton casts, with this group's plain AdamW (no amsgrad, maximize, capturable or
differentiable; a float lr), while ``te_dist.settings.fp8_optimizer_copies`` is on.
Every other parameter, and all of them with the setting off, takes ``torch.optim.AdamW.step`` as it is. The state
is AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``), so a checkpoint moves between the two.

Who says the copy may be used: the op's next forward takes it under the rule of
:mod:`te_dist.ops.basic.weight_copy` (the same storage, version and settings, one more optimizer step, and a
caller driving the micro-batch protocol); a write to the weight that none of these see, between the step and that
forward, is the caller's to avoid, as between a True and a False micro-batch.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from . import settings
from .quantization.optimizer_copy import adamw_step_with_copy, copy_kernels_for

__all__ = ["AdamWWithFP8Copies"]


class AdamWWithFP8Copies(torch.optim.AdamW):
    """``torch.optim.AdamW(params, ...)`` plus ``copies_of``: modules whose ``GroupedLinear`` ops (any module with
    ``optimizer_copy_quantizer``) may have their weight copies written by the update (module docstring)."""

    def __init__(self, params, *args, copies_of: Iterable[torch.nn.Module] = (), **kwargs):
        super().__init__(params, *args, **kwargs)
        self._ops = {}  # id(weight) -> the op that owns it
        for root in copies_of:
            for module in root.modules():
                if hasattr(module, "optimizer_copy_quantizer") and isinstance(getattr(module, "weight", None),
                                                                              torch.Tensor):
                    self._ops[id(module.weight)] = module
        self._host_steps = {}  # id(param) -> its step count on the host (a device step tensor is not read)
        self._pending = []  # (op, copy) offered once the step returns (_offer, a step post hook)
        self.register_step_post_hook(_offer)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._plan() if settings.current().fp8_optimizer_copies and self._ops else []
        grads = [p.grad for _, p, _, _ in plan]
        for _, p, _, _ in plan:  # AdamW's step skips a parameter without a gradient
            p.grad = None
        try:
            super().step()
        finally:
            for (_, p, _, _), g in zip(plan, grads):
                p.grad = g
        self._count_adamw_steps({id(p) for _, p, _, _ in plan})
        for group, p, op, quantizer in plan:
            self._pending.append((op, self._update_with_copy(group, p, quantizer)))
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._host_steps.clear()  # the loaded counts are read at the next step

    def _count_adamw_steps(self, ours: set) -> None:
        """Keep the host counts of the parameters AdamW's own step just took (a weight whose op did not ask for a
        copy this step) in line with their ``state["step"]``."""
        if not self._host_steps:  # nothing counted yet: nothing to follow
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in ours and id(p) in self._host_steps:
                    self._host_steps[id(p)] += 1

    def _plan(self) -> list:
        """(group, param, op, weight quantizer) of every parameter this step updates with its copy."""
        plan = []
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"] or \
                    isinstance(group["lr"], torch.Tensor):
                continue
            for p in group["params"]:
                op, state = self._ops.get(id(p)), self.state.get(p)
                if op is None or p.grad is None or p.grad.is_sparse or not _same_layout(p, p.grad) or (
                        state and not (_same_layout(p, state["exp_avg"]) and _same_layout(p, state["exp_avg_sq"]))):
                    continue  # AdamW's own step
                quantizer = op.optimizer_copy_quantizer()
                if quantizer is not None and copy_kernels_for(p) is not None:
                    plan.append((group, p, op, quantizer))
        return plan

    def _update_with_copy(self, group: dict, p: torch.Tensor, quantizer):
        """AdamW's step of ``p`` and the quantizer's copy of the result (:mod:`.quantization.optimizer_copy`)."""
        state = self.state[p]
        if not state:
            on_device = group["fused"] or group["capturable"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else None)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        steps = self._host_steps.get(id(p))
        if steps is None:  # a fresh or loaded state: its count read once
            steps = int(state["step"].item())
        steps += 1
        self._host_steps[id(p)] = steps
        state["step"].add_(1)
        beta1, beta2 = (float(b) for b in group["betas"])
        return adamw_step_with_copy(quantizer, p, state["exp_avg"], state["exp_avg_sq"], lr=float(group["lr"]),
                                    beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                                    weight_decay=float(group["weight_decay"]), step=steps)


def _same_layout(p: torch.Tensor, t: Optional[torch.Tensor]) -> bool:
    return t is not None and t.dtype == p.dtype and t.shape == p.shape and t.is_contiguous() and p.is_contiguous() \
        and t.device == p.device and p.dim() == 3


def _offer(optimizer: AdamWWithFP8Copies, args, kwargs) -> None:
    """After the step returns (before the global hook counts it): each copy to its op's next forward."""
    pending, optimizer._pending = optimizer._pending, []
    for op, copy in pending:
        op.offer_weight_copy(copy)
