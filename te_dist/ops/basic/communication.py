"""Communication ops over a process group, each with its adjoint as backward.

- ``AllGather``: concatenate every rank's tensor along dim 0; backward reduce-scatters.
- ``ReduceScatter``: sum over ranks and keep this rank's dim-0 chunk; backward all-gathers.
- ``AllReduce``: sum over ranks; backward passes the gradient through (each rank's output
  gradient already is the gradient of its own contribution, as in Megatron's row-parallel input).

``group=None`` means the default (world) group. With one rank every op is the identity.
"""

from __future__ import annotations

from ..op import BasicOperation
from . import _comm

__all__ = ["AllGather", "ReduceScatter", "AllReduce"]


class _CommOp(BasicOperation):
    def __init__(self, group=None):
        super().__init__()
        self.process_group = group

    @property
    def group_size(self) -> int:
        return _comm.world_size(self.process_group)


class AllGather(_CommOp):
    def op_forward(self, ctx, x, extra_inputs, recipe):
        return _comm.all_gather_dim0(x, self.process_group), ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return _comm.reduce_scatter_dim0(dy, self.process_group), [], ()


class ReduceScatter(_CommOp):
    def op_forward(self, ctx, x, extra_inputs, recipe):
        return _comm.reduce_scatter_dim0(x, self.process_group), ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return _comm.all_gather_dim0(dy, self.process_group), [], ()


class AllReduce(_CommOp):
    def op_forward(self, ctx, x, extra_inputs, recipe):
        out = x.clone() if self.group_size > 1 else x  # all_reduce is in place; never write the caller's tensor
        return _comm.all_reduce_sum(out, self.process_group), ()

    def op_backward(self, ctx, dy, grad_extra_outputs):
        return dy, [], ()
