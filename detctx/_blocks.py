"""The per-entry machinery every block form stands on: lock, frame stack, entry and exit.

Each entry of a block pushes a :class:`Frame` (the snapshot taken on entry
and the :class:`~detctx._settings.Seeding` applied) and each exit pops it, so
one configuration object can be entered many times, nested and used
recursively. ``deterministic`` (``with`` and plain decorated functions) uses
:func:`enter` / :func:`exit`; the private worlds of decorated generators and
coroutines use :func:`acquire`, :func:`release`, :func:`position`,
:func:`park` and :func:`unpark` to move their body's open blocks off the
shared stack between steps.

Concurrency: the RNGs are process-global, so blocks are serialised across
threads by one re-entrant lock, held from entry to exit; a thread entering a
block waits until another thread's block has exited. Inside one thread,
blocks must exit in the reverse order of entry. Two asyncio tasks (or
hand-driven generators) holding overlapping ``with`` blocks break that order;
the first out-of-order exit is detected, the state from before the outermost
affected block is restored, and :class:`~detctx.OutOfOrderExitError`
is raised in each affected block.
"""

from __future__ import annotations

import contextvars
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from detctx import _interrupts as interrupts
from detctx._errors import DeterminismWarning, OutOfOrderExitError
from detctx._settings import Seeding
from detctx._snapshot import Snapshot, active_sources
from detctx._sources import RNGSource

__all__ = [
    "WAIT_BEFORE_WARNING_S",
    "Frame",
    "Parked",
    "Position",
    "acquire",
    "context_frames",
    "enter",
    "exit",
    "open_frames",
    "park",
    "position",
    "release",
    "unpark",
]

WAIT_BEFORE_WARNING_S = 10.0
"""Seconds a thread waits for another thread's block before it is warned of a deadlock."""


class Frame:
    """One entry of a block: who entered it, what it saved, what it applied."""

    __slots__ = ("closed", "owner", "seeding", "snapshot")

    def __init__(self, owner: object, snapshot: Snapshot, seeding: Seeding) -> None:
        self.owner = owner
        self.snapshot = snapshot
        self.seeding = seeding
        self.closed = False


_lock = threading.RLock()
_stack: list[Frame] = []
# The frames entered in the current context (thread or asyncio task), innermost last:
# it tells which frame an exit belongs to, and so whether exits come out of order.
_entered: contextvars.ContextVar[tuple[Frame, ...]] = contextvars.ContextVar(
    "detctx_entered", default=()
)


def acquire() -> None:
    """Take the process-wide lock; say so if another thread's block keeps us waiting."""
    if _lock.acquire(timeout=WAIT_BEFORE_WARNING_S):
        return
    warnings.warn(
        f"{threading.current_thread().name} has waited {WAIT_BEFORE_WARNING_S:.0f} s for "
        "another thread's deterministic block to exit (blocks are serialised across threads). "
        "If that thread is waiting for this one, this is a deadlock: do not enter blocks in "
        "threads that a block's owner waits for.",
        DeterminismWarning,
        stacklevel=4,
    )
    _lock.acquire()


def release() -> None:
    """Give back one hold of the process-wide lock."""
    _lock.release()


def open_frames() -> tuple[Frame, ...]:
    """The frames of every block open now, outermost first."""
    return tuple(_stack)


def context_frames() -> tuple[Frame, ...]:
    """The frames of the blocks entered in this thread or asyncio task, innermost last."""
    return _entered.get()


def enter(
    owner: object, apply: Callable[[list[tuple[str, RNGSource]], Snapshot], Seeding]
) -> Seeding:
    """Enter a block for ``owner``: lock, snapshot, ``apply``, push a frame.

    ``apply(sources, snapshot)`` seeds the sources and sets the switches
    (:meth:`~detctx._settings.Settings.apply`). On any failure everything is
    put back and the lock released before the error propagates. A SIGINT
    that arrives meanwhile is held off (:mod:`detctx._interrupts`); the entry
    is then undone and ``KeyboardInterrupt`` raised, as if it came first.
    """
    held = interrupts.hold()
    opened = 0
    try:
        acquire()
        try:
            sources = active_sources()
            snapshot = Snapshot.capture(sources, switches=True)
            try:
                seeding = apply(sources, snapshot)
            except BaseException:
                snapshot.restore()
                raise
            frame = Frame(owner, snapshot, seeding)
            _stack.append(frame)
            _entered.set((*_entered.get(), frame))
            opened = 1
        except BaseException:
            _lock.release()
            raise
        if held and interrupts.pending():
            exit(owner)
    finally:
        interrupts.let_go(held, opened)
    return seeding


def abandon(owner: object, depth: int) -> None:
    """Exit ``owner``'s entry if it was made after this context had ``depth`` blocks.

    For an interrupt raised just after :func:`enter` returned, before the
    caller could take the entry: without it the block would stay open.
    """
    entered = _entered.get()
    if len(entered) > depth and entered[-1].owner is owner:
        exit(owner)


@interrupts.edge
def exit(owner: object) -> None:
    """Exit the innermost block ``owner`` entered in this context, restoring its snapshot."""
    entered = _entered.get()
    for index in range(len(entered) - 1, -1, -1):
        if entered[index].owner is owner:
            break
    else:
        raise OutOfOrderExitError(f"{owner!r} was exited without being entered in this context")
    frame = entered[index]
    held = interrupts.hold()
    try:
        _entered.set(entered[:index] + entered[index + 1 :])
        try:
            _close(frame)
        finally:
            _lock.release()
    finally:
        interrupts.let_go(held, -1)


def _close(frame: Frame) -> None:
    """Pop ``frame`` and restore its snapshot, or fail loudly if exits are out of order."""
    if frame.closed:
        raise OutOfOrderExitError(
            "this deterministic block's state was already restored when a block that "
            "encloses it exited first (overlapping blocks in two asyncio tasks or "
            "generators?); decorate the coroutine or generator function instead"
        )
    index = _stack.index(frame)
    later = _stack[index + 1 :]
    del _stack[index:]
    frame.closed = True
    for other in later:
        other.closed = True
    frame.snapshot.restore()
    if later:
        raise OutOfOrderExitError(
            f"a deterministic block (seed={frame.seeding.seed}) exited while {len(later)} "
            "block(s) entered after it were still open (overlapping blocks in two asyncio "
            "tasks or generators?); the state from before this block was restored. Decorate "
            "the coroutine or generator function instead: each call then gets its own RNG world"
        )


@dataclass(frozen=True)
class Position:
    """Where the shared frame stack and this context's entered frames stood at one moment."""

    depth: int
    entered: tuple[Frame, ...]


@dataclass(frozen=True)
class Parked:
    """Blocks a suspended generator or coroutine body holds open between its steps."""

    frames: tuple[Frame, ...]
    entered: tuple[Frame, ...]


def position() -> Position:
    """The stack's position now, to :func:`park` what is entered after it."""
    return Position(len(_stack), _entered.get())


def park(since: Position) -> Parked | None:
    """Take every block entered after ``since`` off the stack and give back their lock holds.

    Returns them for :func:`unpark`, or ``None`` when none is open.
    """
    now = _entered.get()
    if len(_stack) == since.depth and now is since.entered:
        return None
    frames = tuple(_stack[since.depth :])
    del _stack[since.depth :]
    blocks = now[len(since.entered) :]
    _entered.set(since.entered)
    for _ in blocks:
        _lock.release()
    return Parked(frames, blocks) if frames or blocks else None


def unpark(parked: Parked) -> None:
    """Put parked blocks back on top of the stack; the caller holds the lock."""
    for _ in parked.entered:
        _lock.acquire()
    _stack.extend(parked.frames)
    _entered.set(_entered.get() + parked.entered)


def _after_fork_in_child() -> None:
    """Forget the blocks of the parent's other threads in a forked child.

    A lock held by another thread at ``os.fork()`` stays held for ever in the
    child, where that thread does not exist, and the child's first block
    would wait on it without end. The forking thread's own blocks (a
    ``DataLoader`` worker forked inside a block, say) are the child's too and
    are kept: then the lock is the child's to take.
    """
    global _lock
    if _lock.acquire(blocking=False):
        _lock.release()
        return
    _lock = threading.RLock()
    for frame in _stack:
        frame.closed = True
    del _stack[:]


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)
