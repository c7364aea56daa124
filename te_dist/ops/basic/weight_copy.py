"""The quantized copy of a weight, and when a forward may reuse it.

A weight's quantized copy must equal the quantization of the weight's *current* values, whoever
wrote them. Nothing cheap tells that a weight changed: fused torch optimizers, Megatron-Core's
optimizers (writes through ``.data`` or into a flat parameter buffer) and ``p.data.copy_()`` leave
``param._version`` alone. So the copy is cast at every forward, and reused only where the caller
says the weights did not change: TransformerEngine's ``is_first_microbatch`` protocol, which
Megatron-Core drives (``MegatronModule.set_is_first_microbatch`` sets it True on every module that
has the attribute, once per optimizer step, when the config names an FP8/FP4 recipe).

| ``op.is_first_microbatch`` | a forward on the native path |
|---|---|
| None (default) | casts the weight; keeps nothing |
| True | casts and keeps the copy; the op then sets the attribute to False |
| False | reuses the kept copy while it is valid, else casts and keeps |

A kept copy is valid while the weight keeps its storage and version, the recipe settings are the
same, and no torch optimizer has stepped since it was cast (a process-wide count, kept by a global
``torch.optim`` step hook installed with the first kept copy): a False after an optimizer step still
casts. What stays the caller's word: that nothing wrote the weight behind both autograd and every
torch optimizer (``.data`` writes, a parameter-buffer all-gather) between its True and its False.

An optimizer that writes the copy with its update (``te_dist.optim.AdamWWithFP8Copies``, under
``te_dist.settings.fp8_optimizer_copies``) offers it (:meth:`WeightCopy.offer`) under the key the next forward
will see (the same storage, version and settings, one more optimizer step); a forward whose caller drives the
protocol (True or False) takes it instead of casting, and keeps it. With None the offer is dropped and the forward
casts. The caller's word then also covers the time between the optimizer's step and that forward.

A caller may also ask for the copy ahead of the forward that uses it (:meth:`WeightCopy.prepare`: the MoE
layer queues its experts' weight casts while the dispatch's counts travel to the host, docs/moe.md "The
host read"). The copy so made goes to the next forward only, and only under the same key (storage,
version, settings, optimizer steps): it never outlives a write the key sees, and the rule above holds.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["WeightCopy", "optimizer_steps", "check_microbatch_flag", "set_first_microbatch"]

_steps = [0]  # torch optimizer steps in this process, once the hook is installed
_hook = [None]


def _count_step(optimizer, args, kwargs) -> None:
    _steps[0] += 1


def _install_step_hook() -> None:
    if _hook[0] is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook[0] = register_optimizer_step_post_hook(_count_step)


def optimizer_steps() -> int:
    """Torch optimizer steps taken in this process since the first kept copy (0 before)."""
    return _steps[0]


def check_microbatch_flag(value) -> Optional[bool]:
    """``is_first_microbatch`` must be None, True or False (a typo must not silently reuse a copy)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"is_first_microbatch must be None, True or False, got {value!r}")
    return value


def set_first_microbatch(model: torch.nn.Module, first: Optional[bool]) -> None:
    """Set ``is_first_microbatch`` on every module of ``model`` that has it (what Megatron-Core's
    ``set_is_first_microbatch`` does): a gradient-accumulation loop's True / False per micro-batch."""
    check_microbatch_flag(first)
    for module in model.modules():
        if hasattr(module, "is_first_microbatch"):
            module.is_first_microbatch = first


class WeightCopy:
    """One op's quantized weight copy and its reuse rule (the module docstring)."""

    __slots__ = ("_key", "_copy", "_ready", "_offered", "casts", "offers_taken")

    def __init__(self):
        self._key = None
        self._copy = None
        self._ready = None  # (key, copy) made by prepare() for the next get()
        self._offered = None  # (key, copy) an optimizer wrote with its update, for the next get()
        self.casts = 0  # casts made under the current recipe (what ``te-dist train`` reports)
        self.offers_taken = 0  # optimizer-written copies a forward took instead of casting

    @staticmethod
    def _key_of(weight: torch.Tensor, settings_key: str) -> tuple:
        return (weight._version, weight.data_ptr(), tuple(weight.shape), settings_key, _steps[0])

    def offer(self, weight: torch.Tensor, settings_key: str, copy) -> None:
        """Hand the next forward a copy of ``weight`` that an optimizer wrote with its update, from inside that
        optimizer's step: keyed by the step count the step hook reaches once the step returns (module docstring)."""
        _install_step_hook()
        self._offered = (self._key_of(weight, settings_key)[:-1] + (_steps[0] + 1,), copy)

    def prepare(self, weight: torch.Tensor, settings_key: str, cast: Callable,
                is_first_microbatch: Optional[bool]) -> None:
        """Make now the copy the next :meth:`get` would return (cast, or the kept one), and hand it to that
        ``get`` if it comes with the same key; any other ``get`` drops it."""
        self._ready = None
        key = self._key_of(weight, settings_key)
        self._ready = (key, self._get(key, cast, is_first_microbatch))

    def get(self, weight: torch.Tensor, settings_key: str, cast: Callable, is_first_microbatch: Optional[bool]):
        """The copy for this forward: the kept one when ``is_first_microbatch`` is False and it is still
        valid, else ``cast()`` (kept unless ``is_first_microbatch`` is None)."""
        return self._get(self._key_of(weight, settings_key), cast, is_first_microbatch)

    def _get(self, key: tuple, cast: Callable, is_first_microbatch: Optional[bool]):
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] == key:  # prepare() made it for this forward
            return ready[1]
        offered, self._offered = self._offered, None
        if offered is not None and is_first_microbatch is not None and offered[0] == key:
            self.offers_taken += 1
            self._key, self._copy = key, offered[1]
            return offered[1]
        if is_first_microbatch is False and self._copy is not None and self._key == key:
            return self._copy
        copy = cast()
        self.casts += 1
        if is_first_microbatch is None:
            self._key = self._copy = None
            return copy
        _install_step_hook()
        self._key, self._copy = key, copy
        return copy

    @property
    def kept(self) -> bool:
        """True while a copy is kept for later micro-batches."""
        return self._copy is not None
