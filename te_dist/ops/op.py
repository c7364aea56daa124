"""Operation base classes: what the fuser executes.

Why explicit forward/backward instead of autograd: the fuser runs a whole plan inside ONE autograd
node, so a fused op can replace several basic ops in the forward pass and a different grouping in
the backward pass (for example ``linear+bias+GELU`` forward but ``dGELU+dbias`` backward). That only
works if every basic op stores its saved tensors in a per-op context whose layout the fused ops
share, and if backward is a plain function of that context.

Contracts:
- A basic op saves into ``ctx`` (an :class:`OpContext`) only when ``ctx.requires_grad``.
- ``op_forward(ctx, x, extra_inputs, recipe) -> (y, extra_outputs)``.
- ``op_backward(ctx, dy, grad_extra_outputs) -> (dx, grad_params, grad_extra_inputs)`` where
  ``grad_params`` lines up with ``op.param_list()``.
- A fused op owns nothing: it holds the basic ops it replaces and fills *their* contexts exactly
  as they would, so any backward grouping can follow any forward grouping.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["OpContext", "FusibleOperation", "BasicOperation", "FusedOperation"]

_NO_KEY = object()  # recipe state not built yet (distinct from None = "no recipe")


class OpContext:
    """Per-basic-op scratch space for one forward/backward pair (attribute bag, slots-free on purpose)."""

    __slots__ = ("requires_grad", "input_requires_grad", "saved", "recipe", "op")

    def __init__(self, op: "BasicOperation", requires_grad: bool, recipe):
        self.op = op
        self.requires_grad = requires_grad  # save for backward
        self.input_requires_grad = True  # False only for the first backward op when its input needs no grad
        self.recipe = recipe
        self.saved: tuple = ()


class FusibleOperation(torch.nn.Module):
    """Anything an :class:`~te_dist.ops.fuser.OperationFuser` can run: a basic or a fused op."""

    is_fused_op: bool = False

    def fuser_forward(self, ctxs: Sequence[OpContext], x, extra_inputs: Sequence[tuple], recipe):
        """Forward over the covered basic ops; returns ``(y, [extra_outputs per basic op])``."""
        raise NotImplementedError

    def fuser_backward(self, ctxs: Sequence[OpContext], dy, grad_extra_outputs: Sequence[tuple]):
        """Backward; returns ``(dx, [grad_params per basic op], [grad_extra_inputs per basic op])``."""
        raise NotImplementedError


class BasicOperation(FusibleOperation):
    """One op that owns its parameters and its recipe state (quantizers)."""

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0

    def __init__(self):
        super().__init__()
        self._recipe_key = _NO_KEY

    # ----------------------------------------------------------------- recipe state
    def param_list(self) -> list:
        """Direct parameters in a fixed order (the order ``op_backward`` returns their grads)."""
        return [p for p in self._parameters.values() if p is not None]

    def ensure_recipe_state(self, recipe, key: Optional[str]) -> None:
        """Rebuild recipe state when the settings string changed; never reuse state of other settings."""
        if key is self._recipe_key:
            return
        if key != self._recipe_key:
            self.reset_recipe_state(recipe)
        self._recipe_key = key  # adopt this string object so the caller's identity check hits next time

    def reset_recipe_state(self, recipe) -> None:
        """Build quantizers / amax histories for ``recipe`` (None = no quantization). Default: no state."""

    @property
    def recipe_key(self):
        """The recipe string the op's current recipe state was built for (None: no recipe)."""
        return None if self._recipe_key is _NO_KEY else self._recipe_key

    # ----------------------------------------------------------------- execution
    def op_forward(self, ctx: OpContext, x, extra_inputs: tuple, recipe):
        raise NotImplementedError

    def op_backward(self, ctx: OpContext, dy, grad_extra_outputs: tuple):
        raise NotImplementedError

    def fuser_forward(self, ctxs, x, extra_inputs, recipe):
        y, extra_out = self.op_forward(ctxs[0], x, extra_inputs[0], recipe)
        return y, [extra_out]

    def fuser_backward(self, ctxs, dy, grad_extra_outputs):
        dx, grad_params, grad_extra = self.op_backward(ctxs[0], dy, grad_extra_outputs[0])
        return dx, [grad_params], [grad_extra]

    # The fuser type standalone ops run through: te_dist.ops.fuser sets it when imported (it imports
    # this module, so this module does not import it back); importing te_dist.ops imports both.
    fuser_type = None

    def forward(self, x, *extra_inputs):
        """Standalone use: run this op through a private single-op fuser (plans and autograd included)."""
        fuser = self.__dict__.get("_standalone_fuser")
        if fuser is None:
            fuser = BasicOperation.fuser_type([self])
            self.__dict__["_standalone_fuser"] = fuser  # not a submodule: avoids a module cycle
        return fuser(x, *extra_inputs)

    def extra_repr(self) -> str:
        return ""


class FusedOperation(FusibleOperation):
    """Replaces consecutive basic ops; owns no parameters or state (it uses the basic ops' own)."""

    is_fused_op = True

    def __init__(self, basic_ops: Sequence[BasicOperation]):
        super().__init__()
        # A plain tuple attribute: the basic ops stay owned by the fuser, not registered twice.
        self.__dict__["basic_ops"] = tuple(basic_ops)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(type(op).__name__ for op in self.basic_ops)})"
