"""Methods of one object (a Trainer) replaced on the instance, and put back exactly as they were.

Several pieces wrap a Trainer's methods for the length of a call or a run (the flag agreement after a log or an
evaluation, the straggler clock around the batch fetch). The undo must leave the instance as it found it: an attribute
the instance had of its own is set back; one it took from its class is deleted, so the class's shows through again
(and a later subclass patch or ``unittest.mock`` on the class is not shadowed by a stale copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def replace_methods(owner: Any, makers: dict[str, Callable[[Callable], Callable]]) -> Callable[[], None]:
    """Each method ``name`` of ``owner`` that exists becomes ``makers[name](original)`` on the instance; returns the
    undo. A name ``owner`` lacks is left alone."""
    replaced: dict[str, tuple[bool, Callable]] = {}
    for name, make in makers.items():
        original = getattr(owner, name, None)
        if original is None:
            continue
        replaced[name] = (name in vars(owner), original)
        setattr(owner, name, make(original))

    def restore() -> None:
        for name, (had_own, original) in replaced.items():
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

    return restore
