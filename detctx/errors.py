"""Exception and warning classes raised by detctx."""

from __future__ import annotations

__all__ = [
    "DetctxError",
    "DeterminismWarning",
    "OutOfOrderExitError",
]


class DetctxError(Exception):
    """Base class of every error detctx raises on purpose."""


class OutOfOrderExitError(DetctxError, RuntimeError):
    """A ``deterministic`` block was exited while a block entered after it was still open.

    This happens when two asyncio tasks (or two hand-driven generators) hold
    overlapping ``with deterministic(...)`` blocks in one thread. Their RNG
    states cannot both be right, so detctx restores the state from before the
    outermost affected block and raises this error in each of them. Decorate
    the coroutine or generator function instead: the decorator gives each one
    its own RNG world.
    """


class DeterminismWarning(UserWarning):
    """A determinism switch could not take (full) effect; the message says what to do."""
