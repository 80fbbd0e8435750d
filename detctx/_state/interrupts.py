"""Keeping Ctrl-C out of the middle of a state change.

A ``KeyboardInterrupt`` raised between NumPy's reseed and its key copy, or
between a world swap's capture and its restore, leaves the process half
restored; one raised as a ``with`` block's ``__exit__`` starts leaves the
block open and the lock held. So, in the main thread (the only one Python
runs signal handlers in), while a block is open or a decorated generator's
world is swapped in, SIGINT's handler is detctx's: it hands the signal on at
once, except inside a critical section (entry, exit, a world swap, an atomic
restore: between :func:`hold` and :func:`let_go`) or at the first
instructions of the functions that lead into one (marked with
:func:`edge`). There it records the signal, and the end of the section hands
it to the original handler, which raises ``KeyboardInterrupt`` with the
state whole.

The handler is swapped once per outermost block or step, not per section.
What it costs the user: while a block is open, ``signal.getsignal(SIGINT)``
is detctx's handler (``asyncio.run`` started inside a block then leaves
SIGINT to it), and a handler the user installs inside a block stays in
place, unprotected. Other threads, other signals, and a SIGINT handler that
is not a Python callable (``SIG_IGN``, ``SIG_DFL``) are left alone.

Why the function starts matter: CPython runs Python signal handlers at
function entry (and after calls), so a SIGINT that arrives as a ``with``
body ends is raised at the first instruction of ``__exit__``, before any
``try`` in it can run. With handlers swapped only inside the sections,
``python tests/hammer_interrupts.py 6000`` left a block open within the
first few hundred signals; with the function starts marked, none in 6,000.
"""

from __future__ import annotations

import enum
import importlib
import signal
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, TypeVar

__all__ = ["Effect", "edge", "hold", "let_go", "pending"]

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
_depth = 0  # sections held now
_open = 0  # blocks entered and worlds swapped in, in the main thread
_previous: Any = None  # the handler in place before detctx's, while detctx's is installed
_pending = False


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


def _handler(signum: int, frame: FrameType | None) -> None:
    global _pending
    if _depth or (frame is not None and frame.f_code in _EDGES):
        _pending = True
        return
    (_previous or signal.default_int_handler)(signum, frame)


def _install() -> bool:
    global _previous
    current = _signals.getsignal(signal.SIGINT)
    if current is _handler:
        # Put back by a framework that saved it while a block was open (Lightning's signal
        # connector restores, after fit, the handler it found when fit started): what it
        # replaced is not known any more, so Python's default handler stands for it.
        _previous = signal.default_int_handler
        return True
    if not callable(current):
        return False
    _signals.signal(signal.SIGINT, _handler)
    _previous = current
    return True


@edge
def hold() -> bool:
    """Hold SIGINT off until :func:`let_go`; returns whether this call holds it.

    In the main thread only; cheap while detctx's handler is installed (a
    thread check and a counter).
    """
    global _depth
    if threading.get_ident() != _MAIN:
        return False
    if _previous is None and not _install():
        return False
    _depth += 1
    return True


def pending() -> bool:
    """Whether a SIGINT arrived during the current hold."""
    return _pending


@edge
def let_go(held: bool, effect: Effect = Effect.NONE) -> None:
    """End a :func:`hold`; ``effect``: whether the section opened or closed a block or world.

    The outermost section hands a recorded SIGINT on (``KeyboardInterrupt``
    is raised here, with the state whole), and puts the original handler
    back once nothing is open.
    """
    global _depth, _open, _previous, _pending
    if not held:
        return
    _open = max(_open + effect, 0)
    _depth -= 1
    if _depth:
        return
    previous = _previous
    if not _open:
        _previous = None
        if _signals.getsignal(signal.SIGINT) is _handler:
            _signals.signal(signal.SIGINT, previous)
    if _pending:
        _pending = False
        previous(signal.SIGINT, None)
