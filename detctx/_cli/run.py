"""``detctx run``: start a training command with the determinism environment, read its curve."""

from __future__ import annotations

import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from detctx._basics import NOTES_ENV, SEED_ENV, EntryNote, MetricsError, read_entry_note
from detctx._cli.curves import Curve, Point, parse_line
from detctx._cli.lines import LineReader
from detctx._cli.paths import open_for_writing, refuse_planted
from detctx._cli.signals import (
    GRACE_S,
    RUNS_ENV,
    command_exited,
    mark_run,
    signal_of,
    stop_run,
)
from detctx._environment import env_switches

__all__ = [
    "Progress",
    "RunFailed",
    "RunNotes",
    "determinism_env",
    "determinism_variables",
    "log_file",
    "run_command",
]

_PROGRESS_EVERY: Final = 2.0
"""Seconds between progress reports on stderr."""

_WAKE_S: Final = 0.1
"""Seconds between looks at whether the command exited while its output is quiet."""

_DRAIN_S: Final = 2.0
"""Seconds the output is read for once everything the command started is stopped."""

_CHUNK: Final = 65536

# Windows' select() takes sockets only; there the pipe is read to its end, as before.
_SELECTABLE_PIPES: Final = os.name != "nt"

_Feed = Callable[[bytes], None]

_TAIL_LINES: Final = 15
_TAIL_WIDTH: Final = 300
"""Characters of each of the last lines shown when a run fails."""


class RunFailed(MetricsError):
    """The command exited with a non-zero status; the message holds the end of its output."""


def determinism_variables() -> list[str]:
    """The variables :func:`determinism_env` sets."""
    return [SEED_ENV, *(switch.variable for switch in env_switches())]


def determinism_env(seed: int, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus ``DETCTX_SEED`` and every variable a ``deterministic`` block sets.

    A variable already set to a value the block would keep (``:16:8``,
    ``strict``) stays as it is, and one that is such a value but for
    whitespace or letter case (``' :16:8'``) gets its exact spelling, both
    exactly as inside the block (``EnvSwitch.spelling``).
    """
    env = dict(base)
    env[SEED_ENV] = str(seed)
    for switch in env_switches():
        wanted = switch.target(setting=True, seed=seed, current=env.get(switch.variable))
        if wanted is not None:
            env[switch.variable] = wanted
    return env


class RunNotes:
    """The files each run notes its first block in (:mod:`detctx._basics.run_notes`), in a
    folder of their own removed by :meth:`read` (or at exit, when a run failed)."""

    def __init__(self, runs: int) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="detctx-notes-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)
        self.runs = runs
        for index in range(1, runs + 1):
            # Created here, empty: a run appends to it and never creates one.
            os.close(os.open(self._path(index), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))

    def _path(self, index: int) -> Path:
        return self.folder / f"run{index}.notes"

    def env_for(self, index: int, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` for run ``index`` (1-based), naming the file it notes its first block in."""
        return {**env, NOTES_ENV: str(self._path(index))}

    def read(self) -> list[EntryNote | None]:
        """Each run's note (``None`` for a run that entered no block), then remove them."""
        try:
            return [read_entry_note(self._path(index)) for index in range(1, self.runs + 1)]
        finally:
            self._cleanup()


@dataclass
class Progress:
    """Progress of one run on stderr: a line every few seconds (rewritten on a terminal)."""

    label: str
    stream: IO[str]
    started: float
    last_report: float
    points: int = 0
    last: Point | None = None
    written: str = ""

    def update(self, point: Point | None, *, final: bool = False) -> None:
        if point is not None:
            self.points += 1
            self.last = point
        now = time.monotonic()
        if not final and now - self.last_report < _PROGRESS_EVERY:
            return
        self.last_report = now
        latest = ""
        if self.last is not None:
            step = f" at step {self.last.step}" if self.last.step is not None else ""
            latest = f", latest {self.last.text}{step}"
        values = "metric value" if self.points == 1 else "metric values"
        text = f"{self.label}: {self.points} {values}{latest} ({now - self.started:.0f} s)"
        if text == self.written:  # a short run's final report repeats its last one
            if final and self.stream.isatty():
                self.stream.write("\n")
                self.stream.flush()
            return
        self.written = text
        if self.stream.isatty():
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def run_command(
    command: Sequence[str],
    env: Mapping[str, str],
    pattern: re.Pattern[str],
    label: str,
    *,
    log_path: Path | None = None,
    echo: bool = False,
    progress: IO[str] | None = None,
    watch: Callable[[str], None] | None = None,
) -> Curve:
    """Run ``command`` to the end, reading the metric curve from its stdout and stderr.

    Progress (metric values so far, the latest one) goes to ``progress`` (stderr);
    ``echo`` copies the command's output to stdout; ``log_path`` keeps it; ``watch``
    sees every line.
    Raises :class:`RunFailed` if it exits with a non-zero status and
    :class:`~detctx.MetricsError` if it cannot be started. The command
    runs in its own process group, and its run's id in ``$DETCTX_RUNS``; if
    reading is interrupted (Ctrl-C, or :class:`~detctx._cli.signals.Stopped`
    for SIGTERM / SIGHUP) the same signal goes to that group and to every other
    process of the run (:func:`~detctx._cli.signals.run_processes`), which are
    killed if they are still there after a short wait. When the command exits,
    what it left running is stopped the same way, with SIGTERM, and named on
    ``progress``.
    """
    # Opened first: a log that cannot be written must not leave a command running.
    log = open_for_writing(log_path) if log_path is not None else None
    run_env = dict(env)
    run_id = mark_run(run_env)
    try:
        process = subprocess.Popen(
            list(command),
            env=run_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except BaseException as exc:
        if log is not None:
            log.close()
        if isinstance(exc, FileNotFoundError):
            raise MetricsError(f"command not found: {command[0]}") from None
        if isinstance(exc, OSError):
            raise MetricsError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
        raise
    now = time.monotonic()
    tracker = Progress(label, sys.stderr if progress is None else progress, now, now)
    points: list[Point] = []
    tail: list[str] = []
    reader = LineReader()
    number = 0

    def take(line: str) -> None:
        nonlocal number
        number += 1
        tail.append(line)
        del tail[:-_TAIL_LINES]
        if watch is not None:
            watch(line)
        point = parse_line(line, number, pattern, label)
        if point is not None:
            points.append(point)
        tracker.update(point)

    def feed(chunk: bytes) -> None:
        text = reader.decode(chunk)
        if echo:
            sys.stdout.write(text)
            sys.stdout.flush()
        if log is not None:
            log.write(text)
        for line in reader.feed(text):
            take(line)

    stdout = process.stdout
    assert stdout is not None
    try:
        _read_while_running(process, stdout.fileno(), feed)
        # Whatever the command left running goes now, before the next run starts.
        left = stop_run(process, run_id, int(signal.SIGTERM))
        drained = _drain(stdout.fileno(), feed)
        for line in reader.finish():
            take(line)
        status = process.wait()
    except BaseException as exc:
        stop_run(process, run_id, signal_of(exc))
        raise
    finally:
        stdout.close()
        if log is not None:
            log.close()
    tracker.update(None, final=True)  # ends a terminal's progress line before the notes
    if left:
        tracker.stream.write(_left_text(label, left))
    if not drained:
        tracker.stream.write(
            f"{label}: a process the command started still holds its output open, out of "
            f"reach (it left the command's process group and cleared ${RUNS_ENV}); the "
            "output after this point is not read\n"
        )
    tracker.stream.flush()
    if status != 0:
        ended = _exit_text(status)
        raise RunFailed(f"{label} failed: {shlex.join(command)} {ended}; {_tail(tail)}")
    return Curve(label, tuple(points))


def _read_while_running(process: subprocess.Popen[bytes], pipe: int, feed: _Feed) -> None:
    """Feed the command's output to ``feed`` until the output ends or the command exits.

    The output ends when every process holding the pipe has closed it: a
    background job or a daemon the command started keeps it open after the
    command exits, and ``detctx run -n 2 -- sh -c 'sleep 30 & ...'`` waited
    60.7 s for two ``sleep 30`` (for a daemon: for ever). So the pipe is
    read only while the command runs; :func:`_drain` reads the rest.
    """
    while True:
        if _SELECTABLE_PIPES and not select.select([pipe], [], [], _WAKE_S)[0]:
            if command_exited(process):
                return
            continue
        # What the pipe has now, so progress is not held back by buffering.
        chunk = os.read(pipe, _CHUNK)
        if not chunk:
            return
        feed(chunk)
        if command_exited(process):
            return


def _drain(pipe: int, feed: _Feed) -> bool:
    """Feed the rest of the output, once everything the command started is stopped; False
    when something still held it open after :data:`_DRAIN_S` seconds."""
    deadline = time.monotonic() + _DRAIN_S
    while True:
        wait = deadline - time.monotonic()
        if _SELECTABLE_PIPES and (wait <= 0 or not select.select([pipe], [], [], wait)[0]):
            return False
        chunk = os.read(pipe, _CHUNK)
        if not chunk:
            return True
        feed(chunk)


def _left_text(label: str, pids: Sequence[int]) -> str:
    count = f"{len(pids)} process" + ("" if len(pids) == 1 else "es")
    shown = ", ".join(map(str, pids[:10])) + (", ..." if len(pids) > 10 else "")
    return (
        f"{label}: the command exited and left {count} it started running (pid {shown}); "
        f"stopped with SIGTERM (SIGKILL for any still there after {GRACE_S:g} s)\n"
    )


def _exit_text(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def _tail(lines: Sequence[str]) -> str:
    shown = [line for line in lines if line.strip()]
    if not shown:
        return "it printed nothing (run it by hand to see why)"
    cut = [
        line if len(line) <= _TAIL_WIDTH else f"{line[:_TAIL_WIDTH]}... ({len(line)} characters)"
        for line in shown
    ]
    return "its last lines:\n" + "\n".join(f"    {line}" for line in cut)


def log_file(directory: Path | None, index: int) -> Path | None:
    """Where run ``index`` (1-based) keeps its output, if a log directory was asked for.

    Raises :class:`~detctx.MetricsError` if that path is a symbolic link, a
    FIFO or anything but a regular file, or a hard link: it is neither
    followed, written into nor removed.
    """
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"run{index}.log"
    refuse_planted(path)
    return path
