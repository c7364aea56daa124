"""Agreement of an expert-parallel group on what every rank's copy of a layer must share.

Why: ranks that built different layers do not fail cleanly on their own. With num_experts 4 on one
rank and 8 on another the count all-to-all gets buffers of different sizes (gloo aborts, or a rank
tries to allocate exabytes); a different hidden size or dtype resets the connection; a different
recipe (``te_dist.autocast`` entered without a ``group``) runs silently with other numerics. The
check turns each of these into one :class:`LayerMismatchError`, the same on every rank, naming
the fields and the ranks, before any token moves.

Protocol, per layer::

    key = "MoELayer(num_experts=8, hidden_size=..., dtype=torch.bfloat16, ..., recipe=<key in effect>)"
    first forward      agree_key(key) over the EP group (te_dist.distributed.consensus: a 16-byte digest
                       all-reduce, one string all-gather the first time a key is seen, the per-field
                       diff gathered and raised on every rank on a mismatch)
    every forward      no collective of its own: the key's 62-bit digest (the tag) rides in the token-count
                       all-to-all the dispatcher runs anyway (one int64 per destination rank). Every rank
                       receives every rank's tag, so every rank reaches the same verdict:
                         all tags == the agreed one        nothing more
                         all equal, but new                (the recipe changed on every rank at this step)
                                                           agree_key once more: the strings are compared
                         any differ                        agree_key raises LayerMismatchError on every rank

A later change on some ranks only (a recipe setting written mid-training) is therefore caught at
that step's dispatch, before the expert MLP runs, and no rank waits in a collective that another
rank skipped. The peer-rows transport (GPUs of one host) exchanges its counts in its own kernel and
carries no tag: there the check runs at the first forward only.
"""

from __future__ import annotations

from typing import Optional

import torch

from .consensus import MismatchError, _rank_name, _setting_diff, agree_key, mismatch_groups, recipe_digest, recipe_payload
from .groups import group_size

__all__ = ["LayerMismatchError", "LayerAgreement", "describe_layer_mismatch"]

_NO_RECIPE = "None"


class LayerMismatchError(MismatchError):
    """Ranks of an expert-parallel group built different layers or run different recipes.

    Raised identically on every rank of the group. ``fields`` lists the differing fields
    (``"num_experts"``, ``"recipe"``, ...) in the order the layer declares them.
    """

    def __init__(self, message: str, *, fields, **kwargs):
        super().__init__(message, **kwargs)
        self.fields = list(fields)


def describe_layer_mismatch(payloads: list, global_ranks) -> tuple:
    """``(message, mismatched group ranks, differing fields)`` for payloads gathered from every group rank."""
    ref = payloads[0]
    layer = ref["layer"]
    mismatched, others, headline = mismatch_groups(payloads, global_ranks)
    ref_name = _rank_name(0, global_ranks)
    parts = [f"{layer} mismatch across the {len(payloads)} ranks of its expert-parallel group: {headline}"]
    fields = []
    for other_name, other in others:
        parts.append(f"  {other_name} vs {ref_name}:")
        for name, value in ref["fields"].items():
            if other["fields"].get(name) != value:
                fields.append(name)
                parts.append(f"    {name}: {value} on {ref_name}, {other['fields'].get(name)} on {other_name}")
        if other["recipe"]["key"] != ref["recipe"]["key"]:
            fields.append("recipe")
            parts.append("    recipe:")
            parts.extend(f"      {line}" for line in _setting_diff(ref["recipe"], other["recipe"], ref_name, other_name))
        if not fields:  # same fields and recipe, different keys: show the keys rather than nothing
            parts.append(f"    key: {ref['key']!r} on {ref_name}, {other['key']!r} on {other_name}")
    parts.append(
        f"Every rank of an expert-parallel group must build the {layer} with the same arguments and run it "
        "under the same recipe (te_dist.autocast), changed at the same step."
    )
    return "\n".join(parts), mismatched, list(dict.fromkeys(fields))


def _layer_mismatch(payloads: list, global_ranks) -> LayerMismatchError:
    message, mismatched, fields = describe_layer_mismatch(payloads, global_ranks)
    keys = {r: p["key"] for r, p in enumerate(payloads)}
    return LayerMismatchError(message, fields=fields, mismatched_ranks=mismatched, keys=keys,
                              global_ranks=global_ranks)


class LayerAgreement:
    """One layer's agreement state: the fields its ranks must share and the key last agreed.

    ``fields``: name -> value, rendered with ``str`` (ints, strings, dtypes, bools, None).
    ``group``: the expert-parallel group (None or a group of one: every call is free).
    """

    def __init__(self, layer: str, fields: dict, group):
        self.layer = layer
        self.fields = {name: str(value) for name, value in fields.items()}
        self.group = group
        self.active = group_size(group) > 1
        self._prefix = f"{layer}(" + ", ".join(f"{k}={v}" for k, v in self.fields.items())
        self._agreed_digest = None  # identical on every rank once set
        self._recipe_key = None  # the recipe key the local key was built from
        self._recipe = None  # the recipe of that key (its settings go into a mismatch report)
        self._key = self._digest = None
        self._tags = {}  # device -> int64 [1] tag tensor of the current key

    def _local(self, recipe_key: Optional[str]) -> None:
        if self._key is None or (recipe_key is not self._recipe_key and recipe_key != self._recipe_key):
            self._recipe_key = recipe_key
            self._key = f"{self._prefix}, recipe={_NO_RECIPE if recipe_key is None else recipe_key})"
            self._digest = recipe_digest(self._key)
            self._tags = {}

    def _payload(self, recipe_key: Optional[str]) -> dict:
        recipe = recipe_payload(self._recipe if recipe_key is not None else None)
        recipe["key"] = _NO_RECIPE if recipe_key is None else recipe_key  # the key in effect (agreed, under a group)
        return {"key": self._key, "layer": self.layer, "fields": self.fields, "recipe": recipe}

    def _agree(self, recipe_key: Optional[str]) -> None:
        agree_key(self._key, self.group, payload=lambda: self._payload(recipe_key), mismatch=_layer_mismatch,
                  what=f"{self.layer} agreement")
        self._agreed_digest = self._digest

    def check(self, device: torch.device, recipe=None, recipe_key: Optional[str] = None) -> Optional[torch.Tensor]:
        """At each forward, before dispatch: the tag for the count exchange (None: no EP group).
        ``recipe``, ``recipe_key``: the active recipe and its (agreed) key, None outside autocast;
        the layer passes them, so this module does not read the autocast state itself.

        The first call agrees over the group (a collective: every rank's first forward calls it).
        """
        if not self.active:
            return None
        self._recipe = recipe
        self._local(recipe_key if recipe is not None else None)
        recipe_key = self._recipe_key
        if self._agreed_digest is None:
            self._agree(recipe_key)
        tag = self._tags.get(device)
        if tag is None:  # a host-to-device copy only when the key changed
            tag = self._tags[device] = torch.tensor([self._digest], dtype=torch.int64, device=device)
        return tag

    def verify(self, tags) -> None:
        """After the count exchange: ``tags`` holds every rank's tag (identical lists on every rank),
        or None where the transport carried none. Raises :class:`LayerMismatchError` on every rank."""
        if tags is None or not self.active:
            return
        if all(t == self._agreed_digest for t in tags):
            return
        self._agree(self._recipe_key)  # every rank gets here: a new key everywhere, or a mismatch
