"""Process-wide caches, and the one seam that empties them all.

A cache here holds something looked up once per process (the accelerators
present, the sources a block manages) and kept until what it depends on
visibly changes. What it cannot see change is a monkeypatched or reloaded
backend: ``torch.cuda.is_initialized`` patched for one test and put back
leaves the cached device sources built on the patch. :func:`reset_caches`
forgets every registered cache, so a test fixture (and a program that swaps
a backend) starts from what the process holds now::

    from detctx._basics import reset_caches
    reset_caches()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["process_cache", "reset_caches"]

_Reset = TypeVar("_Reset", bound=Callable[[], None])

_resets: list[Callable[[], None]] = []


def process_cache(reset: _Reset) -> _Reset:
    """Register ``reset``, a function that empties one process-wide cache (a decorator)."""
    _resets.append(reset)
    return reset


def reset_caches() -> None:
    """Empty every registered cache; each is rebuilt on its next use."""
    for reset in _resets:
        reset()
