"""Sequential: like torch.nn.Sequential, but runs each run of consecutive basic ops as one fuser.

Other modules pass through unchanged (they take the running tensor only). Extra inputs
(``model(x, *extra_inputs)``) are handed out in order: each fuser takes ``fuser.num_extra_inputs``
of them. Extra outputs of all fusers are collected and returned after the output:
``(y, *extra_outputs)`` when any op has extra outputs, else ``y``.
"""

from __future__ import annotations

import torch

from .fuser import OperationFuser
from .op import BasicOperation

__all__ = ["Sequential"]


class Sequential(torch.nn.Module):
    def __init__(self, *modules: torch.nn.Module):
        super().__init__()
        for i, module in enumerate(modules):
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"Sequential items must be torch.nn.Module instances; item {i} is {type(module).__name__}")
            if getattr(module, "is_fused_op", False):
                raise TypeError(f"Sequential takes basic ops, not fused op {type(module).__name__} (item {i})")
            self.add_module(str(i), module)
        groups, run = [], []
        for module in modules:
            if isinstance(module, BasicOperation):
                run.append(module)
                continue
            if run:
                groups.append(OperationFuser(run))
                run = []
            groups.append(module)
        if run:
            groups.append(OperationFuser(run))
        # Not submodules: the ops are registered above under their indices (state_dict keys "0.weight", ...).
        self.__dict__["_groups"] = tuple(groups)
        self.num_extra_inputs = sum(g.num_extra_inputs for g in groups if isinstance(g, OperationFuser))
        self.num_extra_outputs = sum(g.num_extra_outputs for g in groups if isinstance(g, OperationFuser))

    @property
    def fusers(self) -> tuple:
        """The OperationFuser of each run of basic ops, in order."""
        return tuple(g for g in self._groups if isinstance(g, OperationFuser))

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> torch.nn.Module:
        return list(self._modules.values())[index]

    def forward(self, x, *extra_inputs):
        if len(extra_inputs) != self.num_extra_inputs:
            raise TypeError(f"Sequential expects {self.num_extra_inputs} extra input(s), got {len(extra_inputs)}")
        extra_outputs = []
        pos = 0
        for group in self._groups:
            if isinstance(group, OperationFuser):
                n = group._num_extra_inputs
                # .forward, not __call__: fusers are internal (no user hooks), and the call is hot.
                out = group.forward(x, *extra_inputs[pos:pos + n]) if n else group.forward(x)
                pos += n
                if group._num_extra_outputs:
                    x = out[0]
                    extra_outputs.extend(out[1:])
                else:
                    x = out
            else:
                x = group(x)
        if self.num_extra_outputs:
            return (x, *extra_outputs)
        return x
