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

The lock is owned by a thread but is not an ``RLock``: a change that lasts
may be ended from another thread (a framework callback's ``close()`` calling
a block's ``__exit__``), and an ``RLock`` can only be released by its owner,
which left every later block in every thread waiting for ever.

Work that must not run where it is asked for (closing a decorated generator
from a garbage-collector pass, or in a thread that would wait for the lock
its owner holds while waiting for that thread) is put off with :func:`defer`
and run by the next change or end that can run it.
"""

from __future__ import annotations

import enum
import gc
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, TypeVar

import detctx._state.interrupts as interrupts
from detctx._basics import DeterminismWarning, warn_at_user

__all__ = [
    "WAIT_BEFORE_WARNING_S",
    "Lasts",
    "State",
    "change",
    "collecting",
    "defer",
    "end",
    "give_back_holds",
    "held_elsewhere",
    "on_fork",
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

_mutex = threading.Lock()
_owner: int | None = None  # the thread that holds the lock now
_holds = 0  # holds of the lock now, all by its owner
# What the outermost hold captured: the state from before every change in force now.
_baseline: State | None = None
_deferred: list[Callable[[], None]] = []


def _acquire(*, warn: bool = True) -> None:
    global _holds, _owner
    if not _fork_handler:
        _register_fork_handler()
    me = threading.get_ident()
    if _owner != me:
        if not _mutex.acquire(timeout=WAIT_BEFORE_WARNING_S if warn else -1):
            warn_at_user(
                f"{threading.current_thread().name} has waited {WAIT_BEFORE_WARNING_S:.0f} s "
                "for another thread's deterministic block to exit (blocks are serialised "
                "across threads). If that thread is waiting for this one, this is a deadlock: "
                "do not enter blocks in threads that a block's owner waits for.",
                DeterminismWarning,
            )
            _mutex.acquire()
        _owner = me
    _holds += 1


def _release() -> None:
    global _holds, _baseline, _owner
    _holds -= 1
    if not _holds:
        _baseline = None
        _owner = None
        _mutex.release()


def held_elsewhere() -> bool:
    """Whether another thread holds the lock now (taking it here would wait)."""
    owner = _owner
    return owner is not None and owner != threading.get_ident()


def collecting() -> bool:
    """Whether a garbage-collector pass is running finalizers now (in any thread)."""
    return next(reversed(_gc_phase)) == "start"


# CPython runs the cyclic GC wherever an allocation crosses its threshold, including
# inside ContextVar.set; a finalizer that sets a ContextVar there makes CPython free
# memory it still reads (gh-148891 on 3.10 and 3.11: SIGSEGV in hamt_node_bitmap_clone
# <- contextvar_set). Finalizers that would change state ask collecting() and defer.
# The callback is a C method, moving the phase ("start" or "stop") last: a Python
# callback would be a place where Python drops a KeyboardInterrupt ("Exception
# ignored in: <function ...>"), and Ctrl-C was lost.
_gc_phase: OrderedDict[str, None] = OrderedDict(start=None, stop=None)
# The info dict it is called with is never empty, so it reads as last=True.
gc.callbacks.append(_gc_phase.move_to_end)  # type: ignore[arg-type]


def defer(action: Callable[[], None]) -> None:
    """Run ``action`` at the next change or end that can (outside a GC pass, lock free or ours)."""
    _deferred.append(action)


def _run_deferred() -> None:
    if collecting() or held_elsewhere():
        return
    while _deferred:
        action = _deferred.pop(0)
        try:
            action()
        except Exception as exc:  # a finalizer's failure: reported, as Python reports those
            warn_at_user(
                f"closing an abandoned decorated generator or coroutine raised "
                f"{type(exc).__name__}: {exc}",
                DeterminismWarning,
            )


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
    for a change that lasts, how to end it when a signal arrived during the
    transaction and its handler raised (it must call :func:`end`); the error
    (``KeyboardInterrupt``, ``SystemExit``) is then raised with the state as it
    was before. A handler that returns leaves the change in force.
    """
    global _baseline
    if _deferred:
        _run_deferred()
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
                try:
                    interrupts.deliver_pending()
                except BaseException:  # a handler raised: as if it came before the change
                    undo(result)
                    raise
    finally:
        interrupts.let_go(held, effect)
    return result


@interrupts.edge
def end(finish: Callable[[], None], *, closing_for: int | None = None) -> None:
    """End a change made with :attr:`Lasts.UNTIL_END`: ``finish()``, then release its hold.

    ``finish`` puts the state back (every part attempted, the first failure
    raised afterwards); the hold is released whatever it raises, SIGINT held
    off meanwhile. ``closing_for``: the thread that made the change, when it
    is ended from another one; its hold is released on its behalf.
    """
    effect = interrupts.Effect.CLOSED
    if closing_for is not None and closing_for != threading.get_ident():
        # Counted (or not) where it was opened, not here.
        interrupts.closed_elsewhere(closing_for)
        effect = interrupts.Effect.NONE
    held = interrupts.hold()
    try:
        try:
            finish()
        finally:
            _release()
    finally:
        interrupts.let_go(held, effect)
    if _deferred:
        _run_deferred()


def give_back_holds(count: int) -> None:
    """Release ``count`` holds that suspended changes keep (parked blocks, between steps):
    out of force, they no longer count as open for the signal handling either."""
    interrupts.count_open(-count)
    for _ in range(count):
        _release()


def take_holds(count: int) -> None:
    """Take ``count`` holds back for suspended changes resumed by the lock's owner."""
    for _ in range(count):
        _acquire(warn=False)
    interrupts.count_open(count)


def _reset_after_fork() -> bool:
    """In a forked child: undo the changes another thread had in force; whether it had any.

    A lock held by another thread at ``os.fork()`` stays held for ever in the
    child, where that thread does not exist, and its changes (a block's seeds,
    flags and variables) would stay in force with nobody to end them. So the
    child puts back the state from before them and starts with a free lock.
    The forking thread's own changes (a ``DataLoader`` worker forked inside a
    block, say) are the child's too and are kept: then the lock is the
    child's to take.
    """
    global _mutex, _owner, _holds, _baseline
    me = threading.get_ident()
    if _owner == me:
        interrupts.after_fork(open_here=_holds)
        return False
    if _owner is None:
        if _mutex.locked():
            # Another thread was between taking the lock and naming itself its owner, or
            # between clearing the name and giving it back: nothing of its is in force.
            _mutex = threading.Lock()
        interrupts.after_fork(open_here=0)
        return False
    baseline = _baseline
    _mutex = threading.Lock()
    _owner = None
    _holds = 0
    _baseline = None
    _deferred.clear()  # other threads' finalizers: their objects are the parent's
    interrupts.after_fork(open_here=0)
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


_fork_listeners: list[Callable[[bool], None]] = []
_fork_handler = False  # registered at the lock's first use
_fork_handler_lock = threading.Lock()


def on_fork(listener: Callable[[bool], None]) -> None:
    """Call ``listener(undone)`` in a forked child, once the lock is the child's;
    ``undone``: whether changes another thread had in force were put back."""
    _fork_listeners.append(listener)


def _after_fork_in_child() -> None:
    undone = _reset_after_fork()
    for listener in _fork_listeners:
        listener(undone)


def _after_fork_before_first_use() -> None:
    # Registered at import: until the lock's first use nothing is open or held, and a
    # child forked from another thread still has a new main thread for the signals.
    if not _fork_handler:
        interrupts.after_fork(open_here=0)


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_before_first_use)


def _register_fork_handler() -> None:
    # At the lock's first use, not at import: the flags' owners register theirs when the
    # state package is imported, after this module, and the lock's handler, which may put
    # flags back, must run after theirs. Before the first use the lock is free.
    global _fork_handler
    with _fork_handler_lock:  # once, whichever thread takes the lock first
        if _fork_handler:
            return
        _fork_handler = True
    if hasattr(os, "register_at_fork"):  # not on Windows
        os.register_at_fork(after_in_child=_after_fork_in_child)
