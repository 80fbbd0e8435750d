"""Stopping ``detctx run``: the command it started goes down with it.

The command runs in its own session, hence its own process group, so that
one ``killpg`` reaches everything it started (``torchrun``'s workers, a
shell's children). That also takes it out of the terminal's foreground
group, so ``detctx run`` forwards what the terminal would have sent: SIGINT
on Ctrl-C, and SIGTERM or SIGHUP when it is itself told to stop. Without
forwarding, ``kill -TERM`` of ``detctx run`` left the command running as an
orphan (``detctx run -- sleep 600 & kill -TERM $!; pgrep sleep``).

Each signal is also recorded, and :func:`raise_pending` raises it again
before each run starts: C code that runs Python callbacks can swallow the
exception a handler raised (importing torch swallowed a Ctrl-C in 3 of 35
tries), and the command would then run anyway.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Final

__all__ = [
    "GRACE_S",
    "Stopped",
    "forwarded_signals",
    "raise_pending",
    "signal_of",
    "stop_group",
]

GRACE_S: Final = 5.0
"""Seconds a command has to exit after the forwarded signal before its group is killed."""

# Windows has neither SIGKILL nor process groups; there the command alone is stopped.
_KILL: Final = int(getattr(signal, "SIGKILL", signal.SIGTERM))
_FORWARDED: Final = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Stopped(BaseException):
    """``detctx run`` was sent SIGTERM or SIGHUP (a ``BaseException``, as ``KeyboardInterrupt``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def forwarded_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into :class:`Stopped` (and SIGINT into ``KeyboardInterrupt``,
    recorded for :func:`raise_pending`) while the block runs, then put back the handlers
    that were there. Only the main thread can set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        _pending.append(signum)
        raise _exception_for(signum)

    _pending.clear()
    # A signal ignored when detctx run started (nohup ignores SIGHUP; a shell's background
    # job ignores SIGINT) stays ignored, as it would for the command run by hand.
    previous = {
        signum: signal.signal(signum, stop)
        for signum in (int(signal.SIGINT), *_FORWARDED)
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _pending.clear()


_pending: list[int] = []
"""Signals received inside :func:`forwarded_signals`, in order."""


def _exception_for(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


def raise_pending() -> None:
    """Raise the exception of a signal received inside :func:`forwarded_signals`, if any.

    A signal whose exception propagated has ended the command already; one
    that is still pending here had its exception swallowed on the way.
    """
    if _pending:
        raise _exception_for(_pending[0])


def signal_of(exc: BaseException) -> int:
    """The signal to forward to the command for an exception that interrupts a run."""
    if isinstance(exc, Stopped):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    return _KILL


def stop_group(process: subprocess.Popen[bytes], signum: int, grace: float = GRACE_S) -> None:
    """Send ``signum`` to ``process``'s group, wait up to ``grace`` seconds for the process
    to exit, then SIGKILL whatever is left of the group."""
    if not hasattr(os, "killpg"):
        process.kill()
        process.wait()
        return
    _signal_group(process.pid, signum)
    try:
        if signum != _KILL:
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
    finally:
        # Members that outlived the leader or ignored the signal are killed now, and so
        # is everything when a second signal cuts the wait short.
        _signal_group(process.pid, _KILL)
        process.wait()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
