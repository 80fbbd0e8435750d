"""Keeping Ctrl-C out of the middle of a state change.

A ``KeyboardInterrupt`` raised between NumPy's reseed and its key copy, or
between a world swap's capture and its restore, leaves the process half
restored. So the critical sections of entry, exit and world swaps *hold*
SIGINT: in the main thread (the only one Python runs signal handlers in),
SIGINT's handler is swapped for one that only records the signal, once per
outermost section, and put back when the section ends; a recorded signal is
then handed to the original handler, which raises ``KeyboardInterrupt`` with
the state whole. Signals other than SIGINT, a handler that is not a Python
callable (``SIG_IGN``, ``SIG_DFL``) and other threads are left alone.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["hold", "let_go", "pending"]

_MAIN = threading.main_thread().ident
_depth = 0
_previous: Any = None
_pending: FrameType | bool | None = False


def _record(signum: int, frame: FrameType | None) -> None:
    global _pending
    _pending = frame if frame is not None else True


def hold() -> bool:
    """Hold SIGINT off until :func:`let_go`; returns whether this call holds it.

    Cheap: a thread check and, for the outermost hold, one handler swap.
    """
    global _depth, _previous
    if _depth:
        if threading.get_ident() != _MAIN:
            return False
        _depth += 1
        return True
    if threading.get_ident() != _MAIN:
        return False
    previous = signal.signal(signal.SIGINT, _record)
    if not callable(previous):
        signal.signal(signal.SIGINT, previous)
        return False
    _previous = previous
    _depth = 1
    return True


def pending() -> bool:
    """Whether a SIGINT arrived during the current hold."""
    return _pending is not False


def let_go(held: bool) -> None:
    """End a :func:`hold`; the outermost one hands a recorded SIGINT to the original handler."""
    global _depth, _previous, _pending
    if not held:
        return
    _depth -= 1
    if _depth:
        return
    previous, _previous = _previous, None
    signal.signal(signal.SIGINT, previous)
    if _pending is not False:
        frame = _pending if isinstance(_pending, FrameType) else None
        _pending = False
        previous(signal.SIGINT, frame)
