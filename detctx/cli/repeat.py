"""``detctx run``: start a training command with the determinism environment, read its curve."""

from __future__ import annotations

import io
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from detctx.cli.curves import Curve, Point, parse_line, split_lines
from detctx.errors import MetricsError
from detctx.seeds import SEED_ENV
from detctx.switches import env_switches

__all__ = ["RunFailed", "determinism_env", "determinism_variables", "log_file", "run_command"]

_PROGRESS_EVERY: Final = 2.0
"""Seconds between progress reports on stderr."""

_TAIL_LINES: Final = 15


class RunFailed(MetricsError):
    """The command exited with a non-zero status; the message holds the end of its output."""


def determinism_variables() -> list[str]:
    """The variables :func:`determinism_env` sets."""
    return [SEED_ENV, *(switch.variable for switch in env_switches())]


def determinism_env(seed: int, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus ``DETCTX_SEED`` and every variable a ``deterministic`` block sets.

    A variable already set to a value the block would keep (``:16:8``,
    ``strict``) stays as it is, exactly as inside the block.
    """
    env = dict(base)
    env[SEED_ENV] = str(seed)
    for switch in env_switches():
        wanted = switch.target(True, seed, env.get(switch.variable))
        if wanted is not None:
            env[switch.variable] = wanted
    return env


@dataclass
class _Progress:
    """Progress of one run on stderr: a line every few seconds (rewritten on a terminal)."""

    label: str
    stream: IO[str]
    started: float
    last_report: float
    points: int = 0
    last: Point | None = None

    def update(self, point: Point | None, final: bool = False) -> None:
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
        text = f"{self.label}: {self.points} metric values{latest} ({now - self.started:.0f} s)"
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
) -> Curve:
    """Run ``command`` to the end, reading the metric curve from its stdout and stderr.

    Progress (metric values so far, the latest one) goes to ``progress`` (stderr);
    ``echo`` copies the command's output to stdout; ``log_path`` keeps it.
    Raises :class:`RunFailed` if it exits with a non-zero status and
    :class:`~detctx.errors.MetricsError` if it cannot be started.
    """
    try:
        process = subprocess.Popen(
            list(command),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    except FileNotFoundError:
        raise MetricsError(f"command not found: {command[0]}") from None
    except OSError as exc:
        raise MetricsError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
    now = time.monotonic()
    tracker = _Progress(label, sys.stderr if progress is None else progress, now, now)
    points: list[Point] = []
    tail: list[str] = []
    log = open(log_path, "w", encoding="utf-8") if log_path is not None else None
    pending = ""
    number = 0

    def take(line: str) -> None:
        nonlocal number
        number += 1
        tail.append(line)
        del tail[:-_TAIL_LINES]
        point = parse_line(line, number, pattern, label)
        if point is not None:
            points.append(point)
        tracker.update(point)

    try:
        stdout = process.stdout
        assert isinstance(stdout, io.BufferedReader)
        while True:
            # read1 returns what the pipe has now, so progress is not held back by buffering.
            chunk = stdout.read1(65536)
            if not chunk:
                break
            text = chunk.decode("utf-8", errors="replace")
            if echo:
                sys.stdout.write(text)
                sys.stdout.flush()
            if log is not None:
                log.write(text)
            *lines, pending = split_lines(pending + text)
            for line in lines:
                take(line)
        if pending:
            take(pending)
        status = process.wait()
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        if log is not None:
            log.close()
    tracker.update(None, final=True)
    if status != 0:
        shown = "\n".join(f"    {line}" for line in tail if line.strip())
        raise RunFailed(
            f"{label} failed: {shlex.join(command)} exited with status {status}; "
            f"its last lines:\n{shown}"
        )
    return Curve(label, tuple(points))


def log_file(directory: Path | None, index: int) -> Path | None:
    """Where run ``index`` (1-based) keeps its output, if a log directory was asked for."""
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"run{index}.log"
