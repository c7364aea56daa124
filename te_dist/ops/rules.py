"""Fusion rules and the registries that own them.

Why registries are objects: a rule registered by a test or by a user must be removable again, and
two fuser classes must be able to hold different rule sets. So rules live in a
:class:`FusionRuleRegistry` held by a fuser class (``OperationFuser.rules``; each subclass gets its
own copy) and temporary rules go through ``registry.scope(...)``. Every change bumps
``registry.version``; fusers drop their cached plans when the version they built against is stale.

A rule matches a run of consecutive basic ops by type (``pattern``) and then calls
``build(basic_ops, recipe)``, which may read any recipe setting (including public attributes
attached at runtime, since those are part of the plan key ``str(recipe)``) and returns a fused op
or None to decline.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["FusionRule", "FusionRuleRegistry"]

_DIRECTIONS = ("forward", "backward")
_versions = itertools.count(1)


@dataclass(frozen=True, eq=False)
class FusionRule:
    """Replace consecutive basic ops matching ``pattern`` with ``build(ops, recipe)`` (None declines).

    ``pattern`` is a tuple whose items are a basic-op class or a tuple of alternative classes.
    Longer patterns are tried first; among equal lengths, registration order decides.
    """

    name: str
    direction: str
    pattern: tuple
    build: Callable[..., Optional[object]]

    def __post_init__(self):
        if self.direction not in _DIRECTIONS:
            raise ValueError(f"FusionRule direction must be one of {_DIRECTIONS}, got {self.direction=}")
        if not isinstance(self.pattern, tuple) or not self.pattern:
            raise TypeError(f"FusionRule pattern must be a non-empty tuple of op classes, got {self.pattern!r}")

    def matches(self, ops, start: int, stop: int) -> bool:
        length = len(self.pattern)
        if start + length > stop:
            return False
        return all(isinstance(ops[start + i], kind) for i, kind in enumerate(self.pattern))


class FusionRuleRegistry:
    """An ordered, versioned set of fusion rules owned by a fuser class or a scope."""

    def __init__(self, rules=()):
        self._rules: list = []
        self._sorted: dict = {}
        self.version = next(_versions)
        for rule in rules:
            self.register(rule)

    def _changed(self) -> None:
        self._sorted = {}
        self.version = next(_versions)

    def register(self, rule: FusionRule) -> FusionRule:
        if not isinstance(rule, FusionRule):
            raise TypeError(f"expected a FusionRule, got {type(rule).__name__}")
        if any(r.name == rule.name for r in self._rules):
            raise ValueError(f"a fusion rule named {rule.name!r} is already registered")
        self._rules.append(rule)
        self._changed()
        return rule

    def unregister(self, rule_or_name) -> FusionRule:
        name = rule_or_name if isinstance(rule_or_name, str) else rule_or_name.name
        for i, rule in enumerate(self._rules):
            if rule.name == name:
                del self._rules[i]
                self._changed()
                return rule
        raise KeyError(f"no fusion rule named {name!r}; registered: {self.names()}")

    def names(self) -> list:
        return [r.name for r in self._rules]

    def __iter__(self):
        return iter(tuple(self._rules))

    def __len__(self) -> int:
        return len(self._rules)

    def for_direction(self, direction: str) -> tuple:
        """Rules of one direction, longest pattern first (stable within a length)."""
        rules = self._sorted.get(direction)
        if rules is None:
            rules = tuple(sorted((r for r in self._rules if r.direction == direction), key=lambda r: -len(r.pattern)))
            self._sorted[direction] = rules
        return rules

    def copy(self) -> "FusionRuleRegistry":
        return FusionRuleRegistry(self._rules)

    @contextlib.contextmanager
    def scope(self, *rules: FusionRule, disable=()):
        """Temporarily add ``rules`` and remove the rules named in ``disable``; restored on exit."""
        saved = list(self._rules)
        try:
            for name in disable:
                self.unregister(name)
            for rule in rules:
                self.register(rule)
            yield self
        finally:
            # Restore the exact list (order included): rules registered inside the scope go too.
            self._rules = saved
            self._changed()
