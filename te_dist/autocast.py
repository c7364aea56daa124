"""``te_dist.autocast``: supplies the active recipe (and its agreed key) to fusible ops.

Why a thread-local stack: nested ``autocast`` blocks restore the outer recipe on exit, and two
threads (for example a training thread and an evaluation thread) can run different recipes.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Optional

from .recipe import Recipe

__all__ = ["autocast", "get_active_recipe", "get_recipe_key", "get_recipe_group"]


@dataclass(frozen=True)
class _Frame:
    recipe: Optional[Recipe]
    group: object = None
    agreed_key: Optional[str] = None  # the rank-agreed string when a group was given


class _State(threading.local):
    def __init__(self):
        self.stack: list = []


_state = _State()


@contextlib.contextmanager
def autocast(recipe: Optional[Recipe] = None, enabled: bool = True, group=None):
    """Run the block with ``recipe`` active (``enabled=False`` or ``recipe=None``: no quantization).

    With ``group``, the ranks of that process group agree on the recipe string first (see
    ``te_dist.distributed.sync_recipe``), so every rank keys its fusion plans identically.
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"autocast(recipe=...) expects a te_dist.recipe.Recipe or None, got {type(recipe).__name__}")
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast(enabled=...) expects a bool, got {type(enabled).__name__}")
    active = recipe if enabled else None
    agreed = None
    if active is not None and group is not None:
        from .distributed.consensus import agree_recipe_key  # lazy: distributed is optional at import

        agreed = agree_recipe_key(active, group)
    _state.stack.append(_Frame(active, group, agreed))
    try:
        yield active
    finally:
        _state.stack.pop()


def get_active_recipe() -> Optional[Recipe]:
    """The innermost active recipe of this thread, or None."""
    stack = _state.stack
    return stack[-1].recipe if stack else None


def get_recipe_key() -> Optional[str]:
    """The string fusion plans are keyed on: the rank-agreed one under a group, else ``str(recipe)``."""
    stack = _state.stack
    if not stack:
        return None
    frame = stack[-1]
    if frame.recipe is None:
        return None
    key = str(frame.recipe)
    if frame.agreed_key is not None and key != frame.agreed_key:
        # Settings changed after the ranks agreed: using either string could split the ranks' plans.
        raise RuntimeError(
            "the recipe changed inside autocast(group=...) after the ranks agreed on it "
            f"(agreed {frame.agreed_key}, now {key}); change recipes between autocast blocks"
        )
    return key


def get_recipe_group():
    """The process group of the innermost autocast (None when no group was given)."""
    stack = _state.stack
    return stack[-1].group if stack else None
