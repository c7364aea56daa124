"""Rank-consistent recipe keys: every rank of a group keys its fusion plans by the same string.

Why: a fusion plan decides which kernels and collectives an op sequence runs. Two ranks keyed by
different recipe strings run different plans, and their next collective hangs or mixes up data.

Protocol (one call of :func:`agree_key`, identical on every rank of the group; :func:`sync_recipe`
agrees on recipe keys with it, te_dist.distributed.layer_agreement on layer descriptions)::

    digest d = 62-bit blake2b of the local key ("None" when no recipe)
    all_reduce(MAX) of [d, -d]  ->  [max d, -min d]         (16 bytes, the steady-state cost)
    max == min, digest already verified for this group  ->  agreed, no further collective
    max == min, first time for this group               ->  all_gather the strings once and compare
    max != min                                          ->  all_gather the strings and settings,
                                                            raise a MismatchError on EVERY rank

Every branch is chosen from the all-reduced value (or from history that the same calls built
identically on every rank), so all ranks run the same sequence of collectives: no rank can wait
in a collective that another rank skipped. Every collective has a timeout, so a dead or stuck
peer turns into :class:`ConsensusError` on the survivors instead of a hang.

The collectives run on a CPU (gloo) group: the user's group itself when it is gloo, otherwise a
gloo side group created once per group. On NCCL jobs this keeps the check off the GPU stream and
avoids a device-to-host synchronisation per step.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import hashlib
import json
import threading
import time
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..recipe import Recipe

__all__ = [
    "ConsensusError",
    "MismatchError",
    "RecipeMismatchError",
    "agree_key",
    "sync_recipe",
    "agree_recipe_key",
    "recipe_digest",
    "describe_recipe_mismatch",
    "mismatch_groups",
    "recipe_payload",
    "DEFAULT_TIMEOUT_S",
    "reset_consensus_state",
    "use_side_group_on_gloo",
]

DEFAULT_TIMEOUT_S = 60.0
_NO_RECIPE = "None"  # the key exchanged for "no recipe": rank 0 quantizing and rank 1 not is a mismatch
_MAX_VERIFIED = 64  # distinct agreed keys remembered per group (more means a full exchange again)
_MAX_DIFF_LINES = 12
_side_group_on_gloo = False  # use_side_group_on_gloo: the NCCL-style side group on gloo-only machines


class ConsensusError(RuntimeError):
    """A consensus collective failed or timed out: a peer died, hung, or left the group."""


class MismatchError(RuntimeError):
    """Ranks of a group hold different keys; raised identically on every rank of the group.

    ``mismatched_ranks`` are group ranks whose key differs from group rank 0's (the authoritative
    one); ``keys`` maps every group rank to its key; ``global_ranks`` maps group ranks to global ones.
    """

    def __init__(self, message: str, *, mismatched_ranks, keys, global_ranks):
        super().__init__(message)
        self.mismatched_ranks = list(mismatched_ranks)
        self.keys = dict(keys)
        self.global_ranks = list(global_ranks)


class RecipeMismatchError(MismatchError):
    """Ranks of a group hold different recipes (the message lists the differing settings)."""


# --------------------------------------------------------------------------- local pieces


def recipe_digest(key: str) -> int:
    """62-bit digest of a recipe key: non-negative, so ``-digest`` fits in int64 for the MIN/MAX trick."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little") >> 2


def _local_key(recipe: Optional[Recipe]) -> str:
    if recipe is None:
        return _NO_RECIPE
    if not isinstance(recipe, Recipe):
        raise TypeError(f"sync_recipe expects a te_dist.recipe.Recipe or None, got {type(recipe).__name__}")
    return str(recipe)


def recipe_payload(recipe: Optional[Recipe]) -> dict:
    """What a rank sends when ranks disagree: enough to print a per-setting diff."""
    if recipe is None:
        return {"key": _NO_RECIPE, "type": "no recipe", "settings": {}}
    return {"key": str(recipe), "type": type(recipe).__name__, "settings": recipe.describe_settings()}


def _rank_name(group_rank: int, global_ranks) -> str:
    global_rank = global_ranks[group_rank]
    return f"rank {group_rank}" if global_rank == group_rank else f"rank {group_rank} (global {global_rank})"


def _ranks_name(group_ranks, global_ranks) -> str:
    if len(group_ranks) == 1:
        return _rank_name(group_ranks[0], global_ranks)
    return "ranks " + ", ".join(_rank_name(r, global_ranks)[len("rank "):] for r in group_ranks)


def _setting_diff(ref: dict, other: dict, ref_name: str, other_name: str) -> list:
    ref_s, other_s = ref["settings"], other["settings"]
    lines = []
    if ref["type"] != other["type"]:
        lines.append(f"recipe class: {ref['type']} on {ref_name}, {other['type']} on {other_name}")
    for name in [n for n in ref_s if n in other_s]:
        if ref_s[name] != other_s[name]:
            lines.append(f"{name}: {ref_s[name]} on {ref_name}, {other_s[name]} on {other_name}")
    only_ref = [n for n in ref_s if n not in other_s]
    only_other = [n for n in other_s if n not in ref_s]
    if ref["type"] == other["type"]:  # a public attribute attached (or deleted) on one side
        lines.extend(f"{n}: {ref_s[n]} on {ref_name}, not set on {other_name}" for n in only_ref)
        lines.extend(f"{n}: not set on {ref_name}, {other_s[n]} on {other_name}" for n in only_other)
    else:  # different classes: list each side's own settings once instead of a line per setting
        for name, side, names in ((ref_name, ref_s, only_ref), (other_name, other_s, only_other)):
            if names:
                lines.append(f"only {name} has: " + ", ".join(f"{n}={side[n]}" for n in names))
    if not lines:  # same settings, different strings: show the strings rather than nothing
        lines.append(f"key: {ref['key']!r} on {ref_name}, {other['key']!r} on {other_name}")
    if len(lines) > _MAX_DIFF_LINES:
        lines = lines[:_MAX_DIFF_LINES] + [f"... and {len(lines) - _MAX_DIFF_LINES} more differences"]
    return lines


def mismatch_groups(payloads: list, global_ranks) -> tuple:
    """``(mismatched group ranks, [(name of a set of ranks, their payload), ...], "differ(s) from rank 0")``:
    ranks whose key differs from rank 0's, grouped by key in rank order, for a mismatch report."""
    ref_key = payloads[0]["key"]
    by_key = collections.OrderedDict()
    for group_rank, payload in enumerate(payloads):
        if payload["key"] != ref_key:
            by_key.setdefault(payload["key"], []).append(group_rank)
    mismatched = [r for ranks in by_key.values() for r in ranks]
    mismatched.sort()
    others = [(_ranks_name(ranks, global_ranks), payloads[ranks[0]]) for ranks in by_key.values()]
    verb = "differs" if len(mismatched) == 1 else "differ"
    headline = f"{_ranks_name(mismatched, global_ranks)} {verb} from {_rank_name(0, global_ranks)}"
    return mismatched, others, headline


def describe_recipe_mismatch(payloads: list, global_ranks) -> tuple:
    """``(message, mismatched group ranks)`` for payloads gathered from every group rank (index = group rank).

    Ranks with the same key are reported together, each group against rank 0 (authoritative).
    """
    ref = payloads[0]
    mismatched, others, headline = mismatch_groups(payloads, global_ranks)
    ref_name = _rank_name(0, global_ranks)
    parts = [f"recipe mismatch across the {len(payloads)} ranks of a group: {headline}, whose recipe is authoritative"]
    for other_name, other in others:
        parts.append(f"  {other_name} vs {ref_name}:")
        parts.extend(f"    {line}" for line in _setting_diff(ref, other, ref_name, other_name))
    parts.append(
        "Every rank must build the same recipe and change it at the same step (a setting written, a public "
        "attribute attached, a different recipe class all count)."
    )
    return "\n".join(parts), mismatched


# --------------------------------------------------------------------------- per-group state


class _GroupConsensus:
    """Consensus state of one process group: its CPU group and the keys already verified on it."""

    def __init__(self, group, timeout_s: float):
        # A weak reference: holding the group would keep it alive past destroy_process_group(),
        # and a gloo group destroyed during interpreter shutdown aborts the process.
        self.group_ref = weakref.ref(group)
        self.global_ranks = list(dist.get_process_group_ranks(group))
        self.group_rank = dist.get_rank(group)
        self.size = len(self.global_ranks)
        self._side_group = self._make_side_group(group, timeout_s)  # None: the group itself is gloo
        self.verified = collections.OrderedDict()  # digest -> key, identical on every rank
        self.last_key = None
        self.last_digest = None
        self.last_pair = None  # [digest, -digest] of last_key, copied into box for each all_reduce
        self.box = torch.empty(2, dtype=torch.int64)

    @property
    def cpu_group(self):
        """The gloo group the consensus collectives run on."""
        return self._side_group if self._side_group is not None else self.group_ref()

    def _make_side_group(self, group, timeout_s: float):
        backend = str(dist.get_backend(group)).lower()
        if "gloo" in backend and not _side_group_on_gloo:
            return None
        # Only this group's ranks take part; every rank of it reaches here at the same consensus call.
        return dist.new_group(
            ranks=self.global_ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)),
            use_local_synchronization=True,
        )

    def digest(self, key: str) -> int:
        if key is not self.last_key:  # str(recipe) is cached, so the steady state skips the hashing
            digest = recipe_digest(key)
            self.last_pair = torch.tensor([digest, -digest], dtype=torch.int64)
            self.last_key, self.last_digest = key, digest
        return self.last_digest

    def remember(self, digest: int, key: str) -> None:
        self.verified[digest] = key
        self.verified.move_to_end(digest)
        while len(self.verified) > _MAX_VERIFIED:
            self.verified.popitem(last=False)


class _Registry:
    """Owner of the per-group states (one per process, keyed by group identity)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._states = {}

    def lookup(self, group) -> Optional[_GroupConsensus]:
        """The state of a group seen before (lock-free: a dict read), else None."""
        state = self._states.get(id(group))
        return state if state is not None and state.group_ref() is group else None

    def get(self, group, timeout_s: float) -> _GroupConsensus:
        state = self.lookup(group)
        if state is not None:
            return state
        with self._lock:
            state = self.lookup(group)
            if state is None:
                # Drop states of groups that no longer exist (their ids may be reused).
                self._states = {k: v for k, v in self._states.items() if v.group_ref() is not None}
                state = _GroupConsensus(group, timeout_s)
                self._states[id(group)] = state
            return state

    def clear(self) -> None:
        with self._lock:
            self._states.clear()


_REGISTRY = _Registry()
# Side groups are ours: release them while the interpreter is still whole (see _GroupConsensus).
atexit.register(_REGISTRY.clear)


def use_side_group_on_gloo(enabled: bool = True) -> None:
    """Give gloo groups the gloo side group NCCL groups get (for groups made after the call): how the
    tests exercise that path on machines without GPUs."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, received {enabled!r}")
    global _side_group_on_gloo
    _side_group_on_gloo = enabled


def reset_consensus_state() -> None:
    """Forget verified keys and side groups (after ``destroy_process_group``, or in tests)."""
    _REGISTRY.clear()


# --------------------------------------------------------------------------- collectives with a timeout


class _Call:
    """What one agreement call reports a failed collective as (``what``), and since when it runs."""

    __slots__ = ("what", "timeout_s", "started")

    def __init__(self, what: str, timeout_s: float):
        self.what, self.timeout_s, self.started = what, timeout_s, time.monotonic()


def _wait(work, state: _GroupConsensus, phase: str, call: _Call) -> None:
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=call.timeout_s))
    except Exception as exc:  # gloo raises on a closed peer connection or on the timeout
        raise _consensus_error(state, phase, call, exc) from exc
    if ok is False:
        raise _consensus_error(state, phase, call, "the collective did not complete")


def _consensus_error(state, phase, call: _Call, cause) -> ConsensusError:
    elapsed, timeout_s = time.monotonic() - call.started, call.timeout_s
    return ConsensusError(
        f"{call.what} failed on {_rank_name(state.group_rank, state.global_ranks)} of a group of "
        f"{state.size} (global ranks {state.global_ranks}) during {phase} after {elapsed:.1f}s "
        f"(timeout {timeout_s:g}s): a peer rank died, hung, or skipped this consensus point. Cause: {cause}"
    )


def _all_reduce_digest(state, call: _Call) -> tuple:
    """(max, min) of the ranks' digests of their last keys."""
    box = state.box
    box.copy_(state.last_pair)
    work = dist.all_reduce(box, op=dist.ReduceOp.MAX, group=state.cpu_group, async_op=True)
    _wait(work, state, "the digest all_reduce", call)
    high, neg_low = box.tolist()
    return high, -neg_low


def _all_gather_text(state, text: str, call: _Call) -> list:
    """All ranks' ``text`` (index = group rank); two fixed-order collectives, both with a timeout."""
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(state.size)]
    work = dist.all_gather(lengths, length, group=state.cpu_group, async_op=True)
    _wait(work, state, "the length all_gather", call)
    sizes = [int(n) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: data.numel()] = data
    buffers = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(state.size)]
    work = dist.all_gather(buffers, padded, group=state.cpu_group, async_op=True)
    _wait(work, state, "the string all_gather", call)
    return [buf[:n].numpy().tobytes().decode("utf-8") for buf, n in zip(buffers, sizes)]


# --------------------------------------------------------------------------- public entry points


def _resolve_group(group, what: str):
    """The group to agree over, or None when consensus is a local no-op."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(f"{what} got group={group!r} but torch.distributed is not initialised")
        return None
    if group is None:
        group = dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"this rank (global {dist.get_rank()}) is not a member of the group given to {what} "
            f"(global ranks {dist.get_process_group_ranks(group)})"
        )
    return group


def _check_timeout(timeout) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be seconds (int/float) or a timedelta, got {type(timeout).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    return float(timeout)


def agree_key(key: str, group, *, payload: Callable[[], dict], mismatch: Callable[[list, list], MismatchError],
              what: str = "recipe consensus", timeout=None) -> bool:
    """Agree on ``key`` across ``group``; True when it ran on a group, False when it was a local no-op.

    On a mismatch every rank gathers every rank's ``payload()`` (a JSON-able dict holding ``"key"``)
    and raises ``mismatch(payloads, global_ranks)``. ``what`` names the check in a
    :class:`ConsensusError` (a dead or stuck peer). See the module docstring for the protocol.
    """
    timeout_s = DEFAULT_TIMEOUT_S if timeout is None else _check_timeout(timeout)
    state = None if group is None else _REGISTRY.lookup(group)  # steady state: skip the group checks
    if state is None:
        group = _resolve_group(group, what)
        if group is None or dist.get_world_size(group) == 1:
            return False
        state = _REGISTRY.get(group, timeout_s)
    call = _Call(what, timeout_s)
    state.digest(key)
    high, low = _all_reduce_digest(state, call)
    if high == low:
        if high in state.verified:  # decided from the digest alone: the same answer on every rank
            state.verified.move_to_end(high)
            return True
        # First time this key is seen on this group: compare the exact strings once (digest collisions).
        keys = _all_gather_text(state, key, call)
        if all(k == keys[0] for k in keys):
            state.remember(high, keys[0])
            return True
    # Every rank is here (the branch depends only on values identical on all ranks): build the diff.
    texts = _all_gather_text(state, json.dumps(payload(), sort_keys=False), call)
    raise mismatch([json.loads(t) for t in texts], state.global_ranks)


def _recipe_mismatch(payloads: list, global_ranks) -> RecipeMismatchError:
    message, mismatched = describe_recipe_mismatch(payloads, global_ranks)
    keys = {r: p["key"] for r, p in enumerate(payloads)}
    return RecipeMismatchError(message, mismatched_ranks=mismatched, keys=keys, global_ranks=global_ranks)


def agree_recipe_key(recipe: Optional[Recipe], group, *, timeout=None) -> Optional[str]:
    """The recipe key all ranks of ``group`` agreed on (None: no recipe on every rank).

    Called by ``te_dist.autocast(group=...)`` at entry; see the module docstring for the protocol.
    """
    key = _local_key(recipe)
    agree_key(key, group, payload=lambda: recipe_payload(recipe), mismatch=_recipe_mismatch,
              what="recipe consensus", timeout=timeout)
    return None if recipe is None else key


def sync_recipe(recipe: Optional[Recipe], group=None, *, timeout=None) -> Optional[str]:
    """Agree on ``recipe``'s key across ``group`` (default: the world) and return it.

    Rank 0's key is authoritative; every rank returns the same string, or every rank raises
    :class:`RecipeMismatchError` naming the differing ranks and settings. A dead or stuck peer
    raises :class:`ConsensusError` within ``timeout`` seconds (default ``DEFAULT_TIMEOUT_S``).
    Without an initialised process group (and ``group=None``) this is a local no-op returning
    ``str(recipe)``. ``recipe=None`` returns None once every rank agrees it has no recipe.
    """
    return agree_recipe_key(recipe, group, timeout=timeout)
