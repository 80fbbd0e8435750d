"""Stopping ``detctx run``: the command it started goes down with it.

The command runs in its own session, hence its own process group, so that
one ``killpg`` reaches everything it started (``torchrun``'s workers, a
shell's children). That also takes it out of the terminal's foreground
group, so ``detctx run`` forwards what the terminal would have sent: SIGINT
on Ctrl-C, and SIGTERM or SIGHUP when it is itself told to stop. Without
forwarding, ``kill -TERM`` of ``detctx run`` left the command running as an
orphan (``detctx run -- sleep 600 & kill -TERM $!; pgrep sleep``).

A group is not all a command starts: a grandchild that calls ``setsid`` (a
daemon) leaves it, and so survived ``kill -TERM`` of ``detctx run``. So each
run is also marked: the command's environment holds the run's id in
``$DETCTX_RUNS``, which every process it starts inherits, in whichever group
or session it ends up. Where ``/proc`` lists processes (Linux), stopping a run
reaches the command's group, every process holding the id and every
descendant of these (:func:`run_processes`). A process that both leaves the
group and clears its environment, then outlives its parent, is out of reach.
The same stop ends what the command left running when it exits by itself (a
background job, a daemon), so one run's processes never overlap the next's.

Each signal is also recorded, and :func:`raise_pending` raises it again
before each run starts: C code that runs Python callbacks can swallow the
exception a handler raised (importing torch swallowed a Ctrl-C in 3 of 35
tries), and the command would then run anyway.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from types import FrameType
from typing import Final

__all__ = [
    "GRACE_S",
    "RUNS_ENV",
    "Stopped",
    "command_exited",
    "forwarded_signals",
    "mark_run",
    "raise_pending",
    "run_processes",
    "signal_of",
    "stop_run",
    "wait_for_exit",
]

RUNS_ENV: Final = "DETCTX_RUNS"
"""The ids of the ``detctx run`` runs a process belongs to, space-separated (runs nest)."""

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


def mark_run(env: MutableMapping[str, str]) -> str:
    """Add a fresh run id to ``env``'s :data:`RUNS_ENV` (kept after the ids of runs this
    one runs inside); return the id."""
    run_id = f"r{secrets.token_hex(8)}"
    outer = env.get(RUNS_ENV, "").split()
    env[RUNS_ENV] = " ".join([*outer, run_id])
    return run_id


def command_exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether the command has exited, without reaping it: until it is reaped, its pid,
    which is also its group's id, cannot be given to another process."""
    if process.returncode is not None:
        return True
    if not hasattr(os, "waitid"):
        return process.poll() is not None
    try:
        found = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler): it is gone
        return True
    return found is not None


def wait_for_exit(process: subprocess.Popen[bytes]) -> None:
    """Block until the command exits, without reaping it (see :func:`command_exited`); a
    signal's exception (:func:`forwarded_signals`) ends the wait."""
    while not command_exited(process):
        if not hasattr(os, "waitid"):
            time.sleep(_POLL_S)
            continue
        try:
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler): it is gone
            return


def run_processes(pgid: int, run_id: str) -> dict[int, int]:
    """The live processes of the run: the members of group ``pgid``, the processes whose
    environment holds ``run_id``, and the descendants of either; by pid, each with its
    group. Empty where ``/proc`` does not list processes."""
    needle = run_id.encode()
    groups: dict[int, int] = {}
    parents: dict[int, int] = {}
    found: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            state, parent, group = fields[0], int(fields[1]), int(fields[2])
            if state in (b"Z", b"X"):  # dead: no signal reaches it, nor is needed
                continue
            parents[pid], groups[pid] = parent, group
            if group == pgid or needle in _environment_of(pid):
                found.add(pid)
        except (OSError, IndexError, ValueError):
            continue  # exited while being read, or not ours to read
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    pending = list(found)
    while pending:
        for child in children.get(pending.pop(), ()):
            if child not in found:
                found.add(child)
                pending.append(child)
    found.discard(os.getpid())
    return {pid: groups[pid] for pid in found}


def _environment_of(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as environ:
        return environ.read()


def stop_run(
    process: subprocess.Popen[bytes], run_id: str, signum: int, grace: float = GRACE_S
) -> list[int]:
    """Send ``signum`` to the command's group and to every other process of the run
    (:func:`run_processes`), wait up to ``grace`` seconds for all of them to exit, then
    SIGKILL whatever is left; reap the command. Returns the pids signalled outside the
    command itself."""
    if not hasattr(os, "killpg"):
        process.kill()
        process.wait()
        return []
    pgid = process.pid
    seen: set[int] = set()
    left = run_processes(pgid, run_id)  # before the signal: what it ends at once is named too
    try:
        _signal_group(pgid, signum)
        deadline = time.monotonic() + grace
        while True:
            for pid, group in left.items():
                # The group's members had the signal from killpg; the others get it once.
                if group != pgid and pid not in seen:
                    _signal(pid, signum)
            seen |= left.keys()
            if signum == _KILL or time.monotonic() >= deadline:
                break
            left = run_processes(pgid, run_id)
            if not left and command_exited(process):
                break
            time.sleep(_POLL_S)
    finally:
        # Members that outlived the leader or ignored the signal are killed now, and so
        # is everything when a second signal cuts the wait short. A process may fork
        # while it is being killed: a few rounds reach its children too.
        for _ in range(_KILL_ROUNDS):
            _signal_group(pgid, _KILL)
            left = run_processes(pgid, run_id)
            seen |= left.keys()
            for pid in left:
                _signal(pid, _KILL)
            if not left:
                break
            time.sleep(_POLL_S)
        process.wait()
    seen.discard(pgid)
    return sorted(seen)


_POLL_S: Final = 0.05
_KILL_ROUNDS: Final = 20


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
