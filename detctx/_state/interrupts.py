"""Keeping Ctrl-C, and every other signal a Python handler raises from, out of the middle
of a state change.

A ``KeyboardInterrupt`` raised between NumPy's reseed and its key copy, or
between a world swap's capture and its restore, leaves the process half
restored; one raised as a ``with`` block's ``__exit__`` starts leaves the
block open and the lock held. A ``SystemExit`` from a SIGTERM handler (the
usual way to save on preemption) or any exception from a SIGUSR1 handler
does the same. So, in the main thread (the only one Python runs signal
handlers in), while a block is open or a decorated generator's world is
swapped in, the handler of every standard signal (1 to 31) that has a Python
handler is detctx's: it hands the signal on at once, except inside a
critical section (entry, exit, a world swap, an atomic restore: between
:func:`hold` and :func:`let_go`) or at the first instructions of the
functions that lead into one (marked with :func:`edge`). There it records
the signal, and the end of the section hands it to the original handler,
with the state whole. In a function marked :func:`skipped` (the GC callback
whose exceptions Python drops, a generator-based context manager's exit) it
sends the signal again a millisecond later, to land past it.

The handlers are swapped once per outermost block or step, not per section.
What it costs the user: while a block is open, ``signal.getsignal(SIGINT)``
(and of each other signal with a Python handler) is detctx's handler
(``asyncio.run`` started inside a block then leaves SIGINT to it), and a
handler the user installs inside a block stays in place, unprotected. Other
threads, real-time signals, and signals without a Python handler
(``SIG_IGN``, ``SIG_DFL``: SIGTERM's default ends the process) are left alone.

Why the function starts matter: CPython runs Python signal handlers at
function entry (and after calls), so a SIGINT that arrives as a ``with``
body ends is raised at the first instruction of ``__exit__``, before any
``try`` in it can run. With handlers swapped only inside the sections,
``python tests/hammer_interrupts.py 6000`` left a block open within the
first few hundred signals; with the function starts marked, none in 6,000.
The ``__exit__`` of a ``contextlib.contextmanager`` (Megatron's
``tracker.fork()``) is marked too: a signal there left the context manager's
generator suspended, and its ``finally`` ran after the block had restored
everything, when the garbage collector closed it (11 of 800).

A forked child inherits the counters; one forked from another thread has a
new main thread, so :func:`after_fork` starts the child's counts afresh.
"""

from __future__ import annotations

import _thread
import contextlib
import enum
import importlib
import operator
import os
import signal
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

__all__ = [
    "Effect",
    "after_fork",
    "closed_elsewhere",
    "count_open",
    "deliver_pending",
    "edge",
    "hold",
    "let_go",
    "pending",
    "skipped",
]

# signal.signal and signal.getsignal map their result to an enum member, which
# raises and catches ValueError for every Python handler: about 2 us each,
# against 0.1 to 0.3 us for the C functions they wrap (compare
# `python -m timeit -s "import signal" "signal.getsignal(2)"` with the same
# for `_signal.getsignal(2)`). Entry and exit call them, so call the C ones.
try:
    _signals: Any = importlib.import_module("_signal")
except ImportError:  # a Python without CPython's C module
    _signals = signal

F = TypeVar("F", bound=Callable[..., Any])

_MAIN = threading.main_thread().ident
_EDGES: set[CodeType] = set()
# Functions a signal must not be raised in, that lead into no section: sent again shortly.
_SKIPPED: set[CodeType] = set()
_depth = 0  # sections held now
_open = 0  # blocks entered and worlds swapped in, in the main thread
# The handlers in place before detctx's, by signal, while detctx's are installed.
_previous: dict[int, Any] = {}
_pending: list[int] = []  # signals that arrived in a section, in order
# The handlers the last install found, and what it swapped for them (see _install).
_last_scan: tuple[list[Any], dict[int, Any]] | None = None
_SCANNED: tuple[int, ...] = tuple(
    s
    for s in range(1, 32)
    if s in signal.valid_signals() and s not in (9, 19)  # KILL, STOP
)


class Effect(enum.IntEnum):
    """What a held section did to the blocks and worlds open in the main thread.

    An ``IntEnum``: ``let_go`` adds it to the count as an int (reading ``.value`` of a
    plain ``Enum`` goes through a Python descriptor, about 0.7 us a call).
    """

    NONE = 0
    OPENED = 1
    CLOSED = -1


def edge(func: F) -> F:
    """Mark ``func`` as leading into a critical section: a SIGINT at its start is held."""
    _EDGES.add(func.__code__)
    return func


def skipped(func: F) -> F:
    """Mark ``func`` as a function a signal must not be raised in (a GC callback, whose
    exceptions Python drops; a context manager's exit): the signal is sent again."""
    _SKIPPED.add(func.__code__)
    return func


def _handler(signum: int, frame: FrameType | None) -> None:
    if _depth:
        if signum not in _pending:
            _pending.append(signum)
        return
    if frame is not None:
        code = frame.f_code
        if code in _EDGES:
            if signum not in _pending:
                _pending.append(signum)  # the section it leads into hands it on
            return
        if code in _SKIPPED:
            _send_again(signum)
            return
    _deliver(signum, frame)


def _send_again(signum: int) -> None:
    # Not from this thread: CPython would run the handler again at the next check in this
    # very handler's frame (the check after a call), before the skipped function goes on.
    # A raw thread, started without waiting: threading.Timer.start() waits for its thread
    # to start, and a copy sent back while it waited (a loaded machine) ran the handler in
    # threading's frames, which raised it into the skipped function after all.
    _thread.start_new_thread(_send_later, (signum,))


def _send_later(signum: int) -> None:
    time.sleep(0.001)
    os.kill(os.getpid(), signum)


def _deliver(signum: int, frame: FrameType | None) -> None:
    previous = _previous.get(signum)
    if previous is None:
        previous = signal.default_int_handler if signum == signal.SIGINT else None
    if previous is not None:
        previous(signum, frame)


def _install() -> bool:
    # Every entry outside a block installs, and the scan is most of its cost: the handlers
    # found are compared, by identity, with the last scan's, whose outcome is then reused.
    global _last_scan
    found = list(map(_signals.getsignal, _SCANNED))
    last = _last_scan
    if last is not None and len(last[0]) == len(found) and all(map(operator.is_, found, last[0])):
        swapped = last[1]
    else:
        swapped = _swapped(found)
        # Reusable while nothing else changes: no handler of detctx's among them.
        _last_scan = None if any(handler is _handler for handler in found) else (found, swapped)
    if not swapped:
        return False
    for signum in swapped:
        if _signals.getsignal(signum) is not _handler:
            _signals.signal(signum, _handler)
    _previous.update(swapped)
    return True


def _swapped(found: list[Any]) -> dict[int, Any]:
    """The handlers detctx's replaces, by signal, given the handlers ``found`` in place."""
    swapped: dict[int, Any] = {}
    for signum, current in zip(_SCANNED, found):
        if current is _handler and signum in _previous:
            continue  # ours, and what it hands on to is known
        if current is _handler:
            # Put back by a framework that saved it while a block was open (Lightning's signal
            # connector restores, after fit, the handler it found when fit started): what it
            # replaced is not known any more, so Python's default action stands for it.
            if signum == signal.SIGINT:
                swapped[signum] = signal.default_int_handler
            else:
                _signals.signal(signum, _signals.SIG_DFL)
        elif callable(current):
            swapped[signum] = current
    return swapped


def _uninstall() -> None:
    previous = dict(_previous)
    _previous.clear()
    for signum, handler in previous.items():
        if _signals.getsignal(signum) is _handler:
            _signals.signal(signum, handler)


@edge
def hold() -> bool:
    """Hold SIGINT off until :func:`let_go`; returns whether this call holds it.

    In the main thread only; cheap while detctx's handler is installed (a
    thread check and a counter).
    """
    global _depth
    if threading.get_ident() != _MAIN:
        return False
    if not _previous and not _install():
        return False
    _depth += 1
    return True


def pending() -> bool:
    """Whether a signal arrived during the current hold."""
    return bool(_pending)


def deliver_pending() -> None:
    """Run the handlers of the signals held so far, now; the first error is raised after all.

    For a change that lasts: only a handler that raises should undo it (a SIGUSR1
    handler that logs must not close the block it interrupted).
    """
    arrived = list(_pending)
    del _pending[:]
    _run_handlers(arrived, dict(_previous))


def _run_handlers(arrived: list[int], handlers: dict[int, Any]) -> None:
    first: BaseException | None = None
    for signum in arrived:
        try:
            handler = handlers.get(signum)
            if handler is not None:
                handler(signum, None)
        except BaseException as exc:  # every handler runs; the first error is raised
            first = first or exc
    if first is not None:
        raise first


@edge
def let_go(held: bool, effect: Effect = Effect.NONE) -> None:
    """End a :func:`hold`; ``effect``: whether the section opened or closed a block or world.

    The outermost section hands a recorded SIGINT on (``KeyboardInterrupt``
    is raised here, with the state whole), and puts the original handler
    back once nothing is open.
    """
    global _depth, _open
    if not held:
        return
    _open = max(_open + effect, 0)
    _depth -= 1
    if _depth:
        return
    handlers = dict(_previous) if _pending else _previous
    if not _open:
        _uninstall()
    if _pending:
        arrived = list(_pending)
        del _pending[:]
        _run_handlers(arrived, handlers)


def count_open(change: int) -> None:
    """Blocks this thread's sections leave in force changed by ``change`` without opening or
    closing (a suspended generator parks its open blocks, and takes them back on resume)."""
    global _open
    if threading.get_ident() == _MAIN:
        _open = max(_open + change, 0)


def closed_elsewhere(thread: int) -> None:
    """A block or world that ``thread`` opened is being closed in another thread."""
    global _open
    if thread == _MAIN:
        # Counted when the main thread opened it; the handlers go back at its next section.
        _open = max(_open - 1, 0)


def after_fork(*, open_here: int) -> None:
    """In a forked child: start the counts afresh if the fork came from another thread.

    ``open_here``: the changes the forking thread had in force, kept in the child.
    A child forked from the main thread goes on with its sections as they were.
    """
    global _MAIN, _depth, _open
    me = threading.get_ident()
    if me == _MAIN:
        return
    _MAIN = me
    _depth = 0
    del _pending[:]
    _open = open_here
    if open_here and not _previous:
        _install()


# A signal at the start of a generator-based context manager's exit (Megatron's
# tracker.fork()) left its generator suspended; run it to its finally first.
_SKIPPED.add(contextlib._GeneratorContextManager.__exit__.__code__)
# A copy sent back that arrives while the handler itself runs (for another signal, or for
# the one it sends back) is sent back again: raised there, it would surface in the function
# the handler was called in.
_SKIPPED.update({_handler.__code__, _send_again.__code__})
