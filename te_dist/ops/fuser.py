"""OperationFuser: runs a list of basic ops through a fusion plan chosen per call.

Per call the fuser computes the plan key ``(recipe key, first_op_requiring_backward)`` — the
recipe key is ``te_dist.autocast.get_recipe_key()`` (``str(recipe)``, cached by the recipe, or the
rank-agreed string), and ``first_op_requiring_backward`` is ``len(ops)`` when no gradient is needed,
0 when the input requires grad, else the first op whose parameters or extra inputs require grad.
Plans are kept in a small bounded map per fuser, so alternating train / no-grad eval or two
recipes reuses plans. Recipe *state* (quantizers) lives in the basic ops and is rebuilt when the
recipe key changes; it is not part of the plan.

The whole plan runs inside one autograd node (:class:`_FuserFunction`): forward fused ops and
backward fused ops may group the basic ops differently because every op's saved state lives in
its own :class:`~te_dist.ops.op.OpContext`. Double backward is not supported.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional, Sequence

import torch

from ..autocast import get_active_recipe, get_recipe_key
from .fused import default_fusion_rules
from .op import BasicOperation, OpContext
from .rules import FusionRule, FusionRuleRegistry

__all__ = ["PlanStep", "FusionPlan", "OperationFuser", "fusion_rules_scope", "MAX_CACHED_PLANS"]

MAX_CACHED_PLANS = 16  # per fuser; a few recipes x {train, eval, partial-freeze} fit


class PlanStep(NamedTuple):
    """One executed op and the indices of the basic ops it covers (ascending)."""

    op: object
    indices: tuple


class FusionPlan:
    """Forward and backward op lists for one key. Backward steps are listed in forward order."""

    __slots__ = ("key", "forward_ops", "backward_ops", "basic_ops", "forward_exec", "backward_exec")

    def __init__(self, key, basic_ops, forward_ops, backward_ops):
        self.key = key
        self.basic_ops = tuple(basic_ops)
        self.forward_ops = tuple(forward_ops)
        self.backward_ops = tuple(backward_ops)
        # Bound methods resolved once per plan, so a call does no attribute lookups per op.
        self.forward_exec = tuple((s.op.fuser_forward, s.indices) for s in self.forward_ops)
        self.backward_exec = tuple((s.op.fuser_backward, s.indices) for s in reversed(self.backward_ops))

    def describe(self) -> str:
        """Human-readable: which basic ops (by index) each forward / backward op covers."""
        recipe_key, first_bwd = self.key
        lines = [f"FusionPlan(recipe={recipe_key!r}, first_op_requiring_backward={first_bwd})", "forward:"]
        lines += [self._line(step) for step in self.forward_ops]
        lines.append("backward (runs bottom to top):")
        lines += [self._line(step) for step in self.backward_ops] or ["  (none)"]
        return "\n".join(lines)

    def _line(self, step: PlanStep) -> str:
        covered = ", ".join(f"[{i}] {type(self.basic_ops[i]).__name__}" for i in step.indices)
        return f"  {type(step.op).__name__:<34} <- {covered}"

    def __repr__(self) -> str:
        return self.describe()


def _fuse(ops, start: int, stop: int, rules, recipe) -> list:
    steps = []
    i = start
    while i < stop:
        for rule in rules:
            if rule.matches(ops, i, stop):
                length = len(rule.pattern)
                fused = rule.build(tuple(ops[i:i + length]), recipe)
                if fused is not None:
                    if tuple(fused.basic_ops) != tuple(ops[i:i + length]):
                        raise RuntimeError(f"fusion rule {rule.name!r} built an op that does not cover exactly the matched ops")
                    steps.append(PlanStep(fused, tuple(range(i, i + length))))
                    i += length
                    break
        else:
            steps.append(PlanStep(ops[i], (i,)))
            i += 1
    return steps


class _FuserFunction(torch.autograd.Function):
    """The single autograd node of a fuser call: inputs = (x, *extra_inputs, *params)."""

    @staticmethod
    def forward(ctx, state, x, *flat):
        fuser, plan, first_bwd, recipe, param_counts = state
        extra_flat = flat[:fuser._num_extra_inputs]
        op_ctxs, y, extra_outputs = fuser._run_forward(plan, first_bwd, recipe, x, extra_flat, x.requires_grad)
        ctx.fuser_state = (fuser, plan, first_bwd, op_ctxs, param_counts)
        if not extra_outputs:
            return y
        return (y, *extra_outputs)

    @staticmethod
    def backward(ctx, dy, *grad_extra_outputs):
        if ctx.fuser_state is None:
            raise RuntimeError(
                "backward ran twice through the same OperationFuser call; its saved tensors are freed after the "
                "first backward (retain_graph=True is not supported), run the forward again"
            )
        fuser, plan, first_bwd, op_ctxs, param_counts = ctx.fuser_state
        ctx.fuser_state = None  # free saved tensors early
        ops = fuser._ops
        num_ops = len(ops)
        grad_params = [None] * num_ops
        grad_extra = [None] * num_ops
        out_slices = fuser._extra_output_slices
        no_extra = fuser._no_extra_inputs
        has_extra_outputs = fuser._num_extra_outputs > 0
        for backward, idx in plan.backward_exec:
            ctxs = [op_ctxs[i] for i in idx]
            if has_extra_outputs:
                dy, gparams, gextra = backward(ctxs, dy, [grad_extra_outputs[out_slices[i]] for i in idx])
            else:
                dy, gparams, gextra = backward(ctxs, dy, no_extra[:len(idx)])
            for j, i in enumerate(idx):
                grad_params[i] = gparams[j]
                grad_extra[i] = gextra[j]
        grads = [None, dy if first_bwd == 0 else None]
        if fuser._num_extra_inputs:
            for i, op in enumerate(ops):
                n = op.num_extra_inputs
                if n:
                    g = grad_extra[i]
                    grads.extend(g if g else (None,) * n)
        for i, n in zip(range(first_bwd, num_ops), param_counts):
            g = grad_params[i]
            if g:
                assert len(g) == n, f"{type(ops[i]).__name__} returned {len(g)} parameter grads for {n} parameters"
                grads.extend(g)
            else:
                grads.extend((None,) * n)
        return tuple(grads)


class OperationFuser(torch.nn.Module):
    """Run basic ops ``ops`` as a fused plan: ``fuser(x, *extra_inputs) -> y`` (+ extra outputs).

    Extra inputs are handed to the ops in order, each op taking ``op.num_extra_inputs`` of them.
    ``fusion_key`` and ``plan`` describe the last call; ``num_plan_builds`` counts plan misses.
    """

    rules = FusionRuleRegistry(default_fusion_rules())  # per class: subclasses get a copy

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "rules" not in cls.__dict__:
            cls.rules = cls.rules.copy()

    def __init__(self, ops: Sequence[BasicOperation]):
        super().__init__()
        ops = list(ops)
        if not ops:
            raise ValueError("OperationFuser needs at least one op, got an empty list")
        for i, op in enumerate(ops):
            if not isinstance(op, BasicOperation):
                raise TypeError(f"OperationFuser ops must be BasicOperation instances; ops[{i}] is {type(op).__name__}")
        if len({id(op) for op in ops}) != len(ops):
            raise ValueError("the same op object appears twice in one OperationFuser; create separate ops")
        self.basic_ops = torch.nn.ModuleList(ops)
        self.__dict__["_ops"] = tuple(ops)
        slices, start = [], 0
        out_slices, out_start = [], 0
        for op in ops:
            slices.append(slice(start, start + op.num_extra_inputs))
            start += op.num_extra_inputs
            out_slices.append(slice(out_start, out_start + op.num_extra_outputs))
            out_start += op.num_extra_outputs
        self._extra_input_slices = tuple(slices)
        self._extra_output_slices = tuple(out_slices)
        self._num_extra_inputs = start
        self._num_extra_outputs = out_start
        self._plans: dict = {}
        self._rules_version = None
        self._no_grad_ctxs = tuple(OpContext(op, False, None) for op in ops)
        self._no_extra_inputs = ((),) * len(ops)
        self.num_plan_builds = 0
        self.fusion_key = None
        self.plan: Optional[FusionPlan] = None

    @property
    def num_extra_inputs(self) -> int:
        return self._num_extra_inputs

    @property
    def num_extra_outputs(self) -> int:
        return self._num_extra_outputs

    # ------------------------------------------------------------------ plans
    def first_op_requiring_backward(self, x, extra_inputs) -> int:
        ops = self._ops
        if not torch.is_grad_enabled():
            return len(ops)
        if x.requires_grad:
            return 0
        slices = self._extra_input_slices
        for i, op in enumerate(ops):
            for p in op._parameters.values():
                if p is not None and p.requires_grad:
                    return i
            if op.num_extra_inputs:
                for t in extra_inputs[slices[i]]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        return i
        return len(ops)

    def get_plan(self, key, recipe) -> FusionPlan:
        """The cached plan for ``key`` (built on a miss). ``key = (recipe key, first_op_requiring_backward)``."""
        registry = type(self).rules
        if self._rules_version != registry.version:
            self._plans.clear()
            self._rules_version = registry.version
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build_plan(key, recipe, registry)
        return plan

    def _build_plan(self, key, recipe, registry) -> FusionPlan:
        ops = self._ops
        first_bwd = key[1]
        fwd_rules = registry.for_direction("forward")
        # Forward fusions may straddle the backward boundary: every basic op's context says whether
        # that op saves for backward, and fused ops honour it per op.
        forward = _fuse(ops, 0, len(ops), fwd_rules, recipe)
        backward = _fuse(ops, first_bwd, len(ops), registry.for_direction("backward"), recipe)
        for name, steps, start in (("forward", forward, 0), ("backward", backward, first_bwd)):
            covered = [i for step in steps for i in step.indices]
            assert covered == list(range(start, len(ops))), f"{name} plan does not cover the ops exactly: {covered}"
        plan = FusionPlan(key, ops, forward, backward)
        if len(self._plans) >= MAX_CACHED_PLANS:
            del self._plans[next(iter(self._plans))]  # oldest first
        self._plans[key] = plan
        self.num_plan_builds += 1
        return plan

    def cached_plan_keys(self) -> list:
        return list(self._plans)

    # ------------------------------------------------------------------ execution
    def forward(self, x, *extra_inputs):
        if len(extra_inputs) != self._num_extra_inputs:
            self._raise_extra_inputs(len(extra_inputs))
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__} input must be a torch.Tensor, got {type(x).__name__}")
        recipe = get_active_recipe()
        recipe_key = None if recipe is None else get_recipe_key()
        ops = self._ops
        for op in ops:
            if op._recipe_key is not recipe_key:  # identity: str(recipe) is cached, so this is the fast path
                op.ensure_recipe_state(recipe, recipe_key)
        first_bwd = self.first_op_requiring_backward(x, extra_inputs)
        key = (recipe_key, first_bwd)
        plan = self._plans.get(key) if self._rules_version == type(self).rules.version else None
        if plan is None:
            plan = self.get_plan(key, recipe)
        state = self.__dict__  # plain attributes: nn.Module.__setattr__ is slow on the hot path
        state["fusion_key"] = key
        state["plan"] = plan
        if first_bwd == len(ops):
            _, y, extra_outputs = self._run_forward(plan, first_bwd, recipe, x, extra_inputs, False)
        else:
            params, param_counts = [], []
            for op in ops[first_bwd:]:
                op_params = op.param_list()
                params += op_params
                param_counts.append(len(op_params))
            out = _FuserFunction.apply((self, plan, first_bwd, recipe, param_counts), x, *extra_inputs, *params)
            if not self._num_extra_outputs:
                return out
            y, extra_outputs = out[0], list(out[1:])
        if not self._num_extra_outputs:
            return y
        return (y, *extra_outputs)

    def _raise_extra_inputs(self, received: int):
        wanted = ", ".join(f"{type(op).__name__}: {op.num_extra_inputs}" for op in self._ops if op.num_extra_inputs)
        raise TypeError(
            f"{type(self).__name__} expects {self._num_extra_inputs} extra input(s) ({wanted or 'none'}), got {received}"
        )

    def _run_forward(self, plan, first_bwd, recipe, x, extra_flat, input_requires_grad):
        ops = self._ops
        num_ops = len(ops)
        if first_bwd == num_ops:
            op_ctxs = self._no_grad_ctxs  # shared: ops write to a context only when it requires grad
        else:
            op_ctxs = [OpContext(op, i >= first_bwd, recipe) for i, op in enumerate(ops)]
            op_ctxs[first_bwd].input_requires_grad = first_bwd == 0 and input_requires_grad
        if self._num_extra_inputs:
            per_op_extra = [extra_flat[s] for s in self._extra_input_slices]
        else:
            per_op_extra = self._no_extra_inputs
        y = x
        if not self._num_extra_outputs:
            for forward, idx in plan.forward_exec:
                if len(idx) == 1:
                    i = idx[0]
                    y, _ = forward((op_ctxs[i],), y, (per_op_extra[i],), recipe)
                else:
                    y, _ = forward([op_ctxs[i] for i in idx], y, [per_op_extra[i] for i in idx], recipe)
            return op_ctxs, y, ()
        extra_outputs = [()] * num_ops
        for forward, idx in plan.forward_exec:
            y, outs = forward([op_ctxs[i] for i in idx], y, [per_op_extra[i] for i in idx], recipe)
            for j, i in enumerate(idx):
                extra_outputs[i] = outs[j]
        return op_ctxs, y, [t for outs in extra_outputs for t in outs]

    def extra_repr(self) -> str:
        return f"num_extra_inputs={self._num_extra_inputs}, cached_plans={len(self._plans)}"


BasicOperation.fuser_type = OperationFuser  # what a standalone op runs through (te_dist.ops.op)


@contextlib.contextmanager
def fusion_rules_scope(*rules: FusionRule, disable=(), fuser_cls=OperationFuser):
    """Temporarily add (or ``disable`` by name) fusion rules of ``fuser_cls``; undone on exit."""
    with fuser_cls.rules.scope(*rules, disable=disable) as registry:
        yield registry
