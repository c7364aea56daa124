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
    agreed_key: Optional[str] = None  # with a group: the rank-agreed string (None: no recipe on any rank)


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
    if group is not None:
        # Also with no recipe: one rank quantizing while another does not is a mismatch too.
        from .distributed.consensus import agree_recipe_key  # lazy: distributed is optional at import

        agreed = agree_recipe_key(active, group)  # raises on every rank alike; nothing pushed yet
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
    """The string fusion plans are keyed on: the rank-agreed one under a group, else ``str(recipe)``.

    Under ``autocast(group=...)`` the key is the one agreed at entry for the whole block, even if
    the recipe object is changed inside it: a change made on some ranks only must not split the
    ranks' plans mid-block. The next ``autocast(group=...)`` entry (the next consensus point)
    sees the change, and raises ``RecipeMismatchError`` on every rank if the ranks now differ.
    """
    stack = _state.stack
    if not stack:
        return None
    frame = stack[-1]
    if frame.group is not None:
        return frame.agreed_key
    recipe = frame.recipe
    return None if recipe is None else str(recipe)


def get_recipe_group():
    """The process group of the innermost autocast (None when no group was given)."""
    stack = _state.stack
    return stack[-1].group if stack else None
