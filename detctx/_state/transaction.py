"""The one way detctx changes the process's state: a transaction.

Every change goes through :func:`change`: entering a block, ``seed_all``, a
decorated generator's or coroutine's world swap, the distributed block,
``restore()`` and ``Snapshot.restore()``. A change that stays in force until
it is undone (an open block, a swapped-in world) is ended by :func:`end`.
A transaction

1. holds SIGINT off (:mod:`detctx._state.interrupts`), so that Ctrl-C lands before
   or after it, never in the middle;
2. takes the process-wide lock (RNGs are process-global, so changes are
   serialised across threads; a thread waiting too long is warned);
3. captures what it is about to change;
4. makes the change, and if that raises anything (``KeyboardInterrupt`` and
   ``SystemExit`` included) puts the captured state back before the error
   propagates;
5. releases the lock now, or at the matching :func:`end`; and a SIGINT
   that arrived meanwhile is raised once the state is whole again (after the
   change is undone, for one that would have stayed in force).

The state is anything with ``restore_each()`` (put every part back, raise
the first failure afterwards): :class:`~detctx._state.snapshot.Snapshot` is.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from detctx._basics import DeterminismWarning, warn_at_user
from detctx._state import interrupts

__all__ = [
    "WAIT_BEFORE_WARNING_S",
    "Lasts",
    "State",
    "change",
    "end",
    "give_back_holds",
    "reset_after_fork",
    "take_holds",
]

WAIT_BEFORE_WARNING_S = 10.0
"""Seconds a thread waits for another thread's block before it is warned of a deadlock."""


class State(Protocol):
    """A captured state a failed change is rolled back to."""

    def restore_each(self) -> None: ...


class Lasts(enum.Enum):
    """How long a change stays in force, and so how long the transaction holds the lock."""

    DONE = "done"
    """Complete when :func:`change` returns (``seed_all``, ``restore``)."""
    UNTIL_END = "until end"
    """In force until :func:`end` (an open block, a swapped-in world)."""


S = TypeVar("S", bound=State)
T = TypeVar("T")

_lock = threading.RLock()
_holds = 0  # holds of _lock now, all by its owner
# What the outermost hold captured: the state from before every change in force now.
_baseline: State | None = None


def _acquire() -> None:
    global _holds
    if not _lock.acquire(timeout=WAIT_BEFORE_WARNING_S):
        warn_at_user(
            f"{threading.current_thread().name} has waited {WAIT_BEFORE_WARNING_S:.0f} s for "
            "another thread's deterministic block to exit (blocks are serialised across "
            "threads). If that thread is waiting for this one, this is a deadlock: do not "
            "enter blocks in threads that a block's owner waits for.",
            DeterminismWarning,
        )
        _lock.acquire()
    _holds += 1


def _release() -> None:
    global _holds, _baseline
    _holds -= 1
    if not _holds:
        _baseline = None
    _lock.release()


@interrupts.edge
def change(
    make: Callable[[S], T],
    capture: Callable[[], S],
    *,
    lasts: Lasts,
    undo: Callable[[T], None] | None = None,
) -> T:
    """Capture with ``capture()``, then ``make(captured)``; roll back if it raises.

    ``lasts``: whether the lock is released on return (:attr:`Lasts.DONE`) or
    held until the matching :func:`end` (:attr:`Lasts.UNTIL_END`). ``undo``:
    for a change that lasts, how to end it when a SIGINT arrived during the
    transaction (it must call :func:`end`); the ``KeyboardInterrupt`` is then
    raised with the state as it was before.
    """
    global _baseline
    held = interrupts.hold()
    effect = interrupts.Effect.NONE
    try:
        _acquire()
        try:
            before = capture()
            if _holds == 1:
                _baseline = before
            try:
                result = make(before)
            except BaseException:
                before.restore_each()
                raise
        except BaseException:
            _release()
            raise
        if lasts is Lasts.DONE:
            _release()
        else:
            effect = interrupts.Effect.OPENED
            if held and undo is not None and interrupts.pending():
                undo(result)
    finally:
        interrupts.let_go(held, effect)
    return result


@interrupts.edge
def end(finish: Callable[[], None]) -> None:
    """End a change made with :attr:`Lasts.UNTIL_END`: ``finish()``, then release its hold.

    ``finish`` puts the state back (every part attempted, the first failure
    raised afterwards); the hold is released whatever it raises, SIGINT held
    off meanwhile.
    """
    held = interrupts.hold()
    try:
        try:
            finish()
        finally:
            _release()
    finally:
        interrupts.let_go(held, interrupts.Effect.CLOSED)


def give_back_holds(count: int) -> None:
    """Release ``count`` holds that suspended changes keep (parked blocks, between steps)."""
    for _ in range(count):
        _release()


def take_holds(count: int) -> None:
    """Take ``count`` holds back for suspended changes resumed by the lock's owner."""
    global _holds
    for _ in range(count):
        _lock.acquire()
        _holds += 1


def reset_after_fork() -> bool:
    """In a forked child: undo the changes another thread had in force; whether it had any.

    A lock held by another thread at ``os.fork()`` stays held for ever in the
    child, where that thread does not exist, and its changes (a block's seeds,
    flags and variables) would stay in force with nobody to end them. So the
    child puts back the state from before them and starts with a free lock.
    The forking thread's own changes (a ``DataLoader`` worker forked inside a
    block, say) are the child's too and are kept: then the lock is the
    child's to take.
    """
    global _lock, _holds, _baseline
    if _lock.acquire(blocking=False):
        _lock.release()
        return False
    baseline = _baseline
    _lock = threading.RLock()
    _holds = 0
    _baseline = None
    if baseline is not None:
        try:
            baseline.restore_each()
        except Exception as exc:  # the child goes on; say what could not be put back
            warn_at_user(
                "a process forked while another thread was inside a deterministic block "
                f"could not put everything back ({type(exc).__name__}: {exc})",
                DeterminismWarning,
            )
    return True
