"""The blocks open now: a stack of entries, each opened and closed by a transaction.

Each entry of a block pushes an :class:`OpenBlock` (the snapshot taken on
entry and the :class:`~detctx.Seeding` applied) and each exit pops it, so
one configuration object can be entered many times, nested and used
recursively. Opening is a :func:`detctx._state.transaction.change` that lasts until
the block is closed (:func:`detctx._state.transaction.end`): the lock, Ctrl-C and
rollback are the transaction's.

Concurrency: the RNGs are process-global, so blocks are serialised across
threads by the transaction's lock, held from entry to exit; a thread entering
a block waits until another thread's block has exited. Inside one thread,
blocks must exit in the reverse order of entry. Two asyncio tasks (or
hand-driven generators) holding overlapping ``with`` blocks break that order;
the first out-of-order exit is detected, the state from before the outermost
affected block is restored, and :class:`~detctx.OutOfOrderExitError` is
raised in each affected block.

The private worlds of decorated generators and coroutines move their body's
open blocks off the stack between steps (:func:`position`, :func:`park`,
:func:`unpark`), so a suspended generator holds no lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from detctx._basics import OutOfOrderExitError
from detctx._blocks.settings import Seeding
from detctx._state import Snapshot, interrupts, transaction

__all__ = [
    "OpenBlock",
    "Parked",
    "Position",
    "abandon",
    "close_block",
    "discarding",
    "entered_here",
    "open_block",
    "park",
    "position",
    "stack",
    "unpark",
]


class OpenBlock:
    """One entry of a block: who entered it, what it saved, what it applied."""

    __slots__ = ("closed", "number", "owner", "restored_to", "seeding", "snapshot", "thread")

    def __init__(self, owner: object, snapshot: Snapshot, seeding: Seeding) -> None:
        global _opened
        self.owner = owner
        self.snapshot = snapshot
        self.seeding = seeding
        self.closed = False
        # The thread object, not its ident: a thread's ident is reused once it has ended.
        self.thread = threading.current_thread()
        _opened += 1
        self.number = _opened
        # Set when an enclosing block exited first: the state it put back, and when.
        self.restored_to: tuple[Snapshot, int] | None = None


_stack: list[OpenBlock] = []
_opened = 0  # blocks opened so far: each one's number
_discarding = False  # interpreter exit: exits of blocks nobody can restore are no-ops
# What the latest exit put back, and how many blocks had been opened then: a block an
# enclosing block's early exit closed puts it back again at its own, late, exit.
_last_restored: tuple[Snapshot, int] | None = None
_closed_early = 0  # such blocks not exited yet; at 0 the snapshot above is let go
# The blocks entered in the current context (thread or asyncio task), innermost last:
# it tells which block an exit belongs to, and so whether exits come out of order.
_entered: contextvars.ContextVar[tuple[OpenBlock, ...]] = contextvars.ContextVar(
    "detctx_entered", default=()
)


def stack() -> tuple[OpenBlock, ...]:
    """Every block open now, in any context, outermost first."""
    return tuple(_stack)


def entered_here() -> tuple[OpenBlock, ...]:
    """The blocks entered in this thread or asyncio task, innermost last."""
    return _entered.get()


def open_block(owner: object, apply: Callable[[Snapshot], Seeding]) -> Seeding:
    """Enter a block for ``owner``: one transaction that snapshots everything,
    ``apply(snapshot)`` (seed the sources, set the switches) and pushes the block.

    On any failure everything is put back and the lock released before the
    error propagates. A SIGINT that arrives meanwhile closes the block again
    and is then raised, as if it came first.
    """

    def make(before: Snapshot) -> Seeding:
        block = OpenBlock(owner, before, apply(before))
        _stack.append(block)
        _entered.set((*_entered.get(), block))
        return block.seeding

    return transaction.change(
        make,
        Snapshot.capture_everything,
        lasts=transaction.Lasts.UNTIL_END,
        undo=lambda _: close_block(owner),
    )


def abandon(owner: object, depth: int) -> None:
    """Close ``owner``'s entry if it was made after this context had ``depth`` blocks.

    For an interrupt raised just after :func:`open_block` returned, before the
    caller could take the entry: without it the block would stay open.
    """
    entered = _entered.get()
    if len(entered) > depth and entered[-1].owner is owner:
        close_block(owner)


@interrupts.edge
def close_block(owner: object) -> None:
    """Exit the innermost block ``owner`` entered in this context, restoring its snapshot."""
    entered = _entered.get()
    for index in range(len(entered) - 1, -1, -1):
        if entered[index].owner is owner:
            break
    else:
        foreign = _entered_elsewhere(owner)
        if foreign is None:
            if _discarding or transaction.collecting():
                # A parked block of an abandoned generator, closed by the GC or at
                # interpreter exit: nothing of it is in force, so there is nothing to
                # restore (its world's own close is deferred, see decorators._drive).
                return
            raise OutOfOrderExitError(f"{owner!r} was exited without being entered in this context")
        # Entered in another thread (a framework's callback closing it, say): that
        # thread's record of it is left behind, marked closed.
        transaction.end(functools.partial(_pop, foreign), closing_for=foreign.thread.ident)
        return
    block = entered[index]

    def finish() -> None:
        _entered.set(entered[:index] + entered[index + 1 :])
        _pop(block)

    transaction.end(finish)


def _entered_elsewhere(owner: object) -> OpenBlock | None:
    """The innermost open block of ``owner`` entered in another thread, if any."""
    me = threading.current_thread()
    for block in reversed(_stack):
        if block.owner is owner and block.thread is not me and not block.closed:
            return block
    return None


@contextlib.contextmanager
def discarding() -> Iterator[None]:
    """While the interpreter exits: a block's exit that finds no entry is a no-op."""
    global _discarding
    _discarding = True
    try:
        yield
    finally:
        _discarding = False


def _pop(block: OpenBlock) -> None:
    """Pop ``block`` and restore its snapshot, or fail loudly if exits are out of order."""
    if block.closed:
        _restore_again(block)
        raise OutOfOrderExitError(
            "this deterministic block's state was already restored when a block that "
            "encloses it exited first (overlapping blocks in two asyncio tasks or "
            "generators?); decorate the coroutine or generator function instead"
        )
    global _last_restored, _closed_early
    index = _stack.index(block)
    later = _stack[index + 1 :]
    del _stack[index:]
    block.closed = True
    for other in later:
        other.closed = True
        other.restored_to = (block.snapshot, _opened)
    _closed_early += len(later)
    _last_restored = (block.snapshot, _opened) if _closed_early else None
    # The later blocks' own changes go first, innermost first, so that the overrides
    # they pushed (the algorithms flag's) leave the stack in order.
    first_error: BaseException | None = None
    for other in reversed(later):
        try:
            other.snapshot.restore_each()
        except BaseException as exc:
            first_error = first_error or exc
    block.snapshot.restore_each()
    if first_error is not None:
        raise first_error
    if later:
        raise OutOfOrderExitError(
            f"a deterministic block (seed={block.seeding.seed}) exited while {len(later)} "
            "block(s) entered after it were still open (overlapping blocks in two asyncio "
            "tasks or generators?); the state from before this block was restored. Decorate "
            "the coroutine or generator function instead: each call then gets its own RNG world"
        )


def _restore_again(block: OpenBlock) -> None:
    """A block closed by an enclosing block's early exit now exits itself: what its body
    drew since moved the state the latest exit put back (the caller's), so put it back
    again, unless blocks were opened since (then that state is theirs to restore).

    The latest exit, not the one that closed this block: in three overlapping tasks,
    B's early exit closes C and puts back the state inside A; A's exit then puts back
    the caller's, and C's late exit must put back that one (it put back A's world, and
    the caller's RNG had moved in 36 of 200 rounds, benchmarks/hammer_async_exits.py).
    """
    global _last_restored, _closed_early
    if block.restored_to is None:
        return
    block.restored_to = None
    _closed_early -= 1
    latest = _last_restored
    if not _closed_early:
        _last_restored = None
    if latest is None:
        return
    snapshot, opened = latest
    if all(other.number <= opened for other in _stack):
        snapshot.restore_each()


@dataclass(frozen=True)
class Position:
    """Where the stack and this context's entered blocks stood at one moment."""

    depth: int
    entered: tuple[OpenBlock, ...]


@dataclass(frozen=True)
class Parked:
    """Blocks a suspended generator or coroutine body holds open between its steps."""

    blocks: tuple[OpenBlock, ...]
    entered: tuple[OpenBlock, ...]


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
    blocks = tuple(_stack[since.depth :])
    del _stack[since.depth :]
    for block in reversed(blocks):
        block.snapshot.lift_changes()
    entered = now[len(since.entered) :]
    _entered.set(since.entered)
    transaction.give_back_holds(len(entered))
    return Parked(blocks, entered) if blocks or entered else None


def unpark(parked: Parked) -> None:
    """Put parked blocks back on top of the stack; the caller holds the lock."""
    transaction.take_holds(len(parked.entered))
    for block in parked.blocks:
        block.snapshot.reapply_changes()
    _stack.extend(parked.blocks)
    _entered.set(_entered.get() + parked.entered)


def _after_fork_in_child(undone: bool) -> None:
    """Forget the blocks of the parent's other threads in a forked child, when the
    transaction put their changes back (``undone``)."""
    if undone:
        for block in _stack:
            block.closed = True
        del _stack[:]
        # Python reseeds `random` in a child so that it does not repeat its parent;
        # putting back the state from before the other thread's blocks undid that.
        random.seed()
    else:
        # The blocks kept would put the parent's `random` state back at their exit.
        for block in _stack:
            block.snapshot.renew_after_fork()


transaction.on_fork(_after_fork_in_child)
