"""``detctx record -o PATH -- CMD ...``: run a command once, recording each op's statistics.

As ``detctx run --locate``, with no change to the script: the command runs
with ``$DETCTX_RECORD_DIR`` naming a folder detctx made next to ``PATH`` and
a ``sitecustomize`` on ``PYTHONPATH`` that starts recording when Python
starts (:mod:`detctx._compare.session`). The first Python process writes
``main.trace``; each rank that torchrun starts writes ``rank<N>.trace``.
When the command ends, ``PATH`` becomes the trace (one process) or a folder
of the ranks' traces, replacing an earlier one only then. Which processes
record, and how the variables leave the environment of those that do not:
:mod:`detctx._cli.record_child`.

The command runs in its own process group, marked as ``detctx run``'s
commands are (:mod:`detctx._cli.signals`): SIGTERM, SIGHUP and Ctrl-C sent
to ``detctx record`` go to the command's group and to every process of it,
what is left after :data:`~detctx._cli.signals.GRACE_S` seconds is killed,
the staging folder goes, and ``detctx record`` exits with 128 + the
signal's number (143, 129; 130 after Ctrl-C) with nothing written. Before,
SIGTERM left the command running and recording, and the staging folder
beside ``PATH``. What the command leaves running when it exits is stopped
too, before its traces are moved. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any, Final

from detctx._basics import (
    PORTABLE_ENV,
    STEPS_ENV,
    TraceError,
    parse_portable,
    parse_steps,
    portable_text,
    steps_text,
)
from detctx._cli.locate import recording_shim
from detctx._cli.signals import (
    GRACE_S,
    Stopped,
    forwarded_signals,
    mark_run,
    signal_of,
    stop_run,
    wait_for_exit,
)
from detctx._cli.trace_compare import compare_recorded, looks_like_trace

__all__ = ["RECORD_ENV", "RUN_ENV", "SITE_FOLDER", "add_arguments", "dispatch", "record"]

RECORD_ENV: Final = "DETCTX_RECORD_DIR"
""":data:`detctx._compare.RECORD_ENV` (importing it from there would import torch)."""

RUN_ENV: Final = "DETCTX_RECORD_RUN"
"""The identity of one ``detctx record`` run: a fresh random hex id in the command's
environment, which every process that records writes in its trace's header
(:func:`detctx._compare.session.run_identity`) and then forgets."""

SITE_FOLDER: Final = "site"
"""The folder in ``$DETCTX_RECORD_DIR`` that holds the shim, and is put on ``PYTHONPATH``."""

_SHIM: Final = recording_shim("detctx record", "record", RECORD_ENV, "detctx._cli.record_child")
_CHUNK: Final = struct.Struct("<cQI")
_TAIL: Final = 4096
"""Bytes at a trace's end read for its end chunk (its outcome is at most 1,024 characters)."""
_COMPLETED: Final = "completed"
""":data:`detctx._compare.format.COMPLETED` (importing it from there would import torch)."""
"""A trace chunk's kind, length and CRC-32 (:mod:`detctx._compare.format`, which imports torch)."""
_UNRECORDED: Final = (
    "the process detctx recorded ran no torch op. detctx record records the first Python "
    "process the command starts, or each rank torchrun starts (RANK and WORLD_SIZE set "
    "when it starts); processes that torch.multiprocessing.spawn or another launcher "
    "(accelerate launch, deepspeed) starts are not recorded. Start the ranks with torchrun, "
    'or record in each worker: with detctx.recording(f"rank{rank}.trace"): ...'
)


def _earlier(path: Path) -> list[Path]:
    """The earlier recording at ``path`` a new one replaces (its traces, then its folder);
    anything else there is refused."""
    if path.is_symlink() or (path.exists() and not looks_like_trace(path)):
        raise TraceError(
            f"{path} exists and is not a trace detctx recorded: choose another path or remove it"
        )
    if not path.is_dir():
        return [path] if path.exists() else []
    traces = [child for child in path.iterdir() if looks_like_trace(child)]
    others = sorted(child.name for child in path.iterdir() if child not in traces)
    if others:
        raise TraceError(
            f"{path} holds {', '.join(others[:3])} besides rank traces: choose another "
            "path or remove them"
        )
    return [*traces, path]


def _replace_earlier(path: Path) -> None:
    for old in _earlier(path):
        if old.is_dir():
            old.rmdir()
        else:
            old.unlink(missing_ok=True)


def record(
    path: Path,
    command: list[str],
    steps: tuple[int, int] | None = None,
    *,
    portable_random: int | bool | None = None,
) -> int:
    """Run ``command`` once, recording into ``path``; the exit status of ``detctx record``.

    ``steps``: the window of optimizer steps recorded; ``portable_random``: ``True`` or a
    seed, every random op drawn portably (:func:`detctx.recording`'s options, handed to
    the recording processes in ``$DETCTX_RECORD_STEPS`` and
    ``$DETCTX_RECORD_PORTABLE_RANDOM``).

    Raises ``KeyboardInterrupt`` or :class:`~detctx._cli.signals.Stopped` when
    ``detctx record`` is stopped, once the command is and nothing was written.
    """
    shown, path = path, path.absolute()
    if not path.parent.is_dir():
        raise TraceError(f"the folder of {path} does not exist")
    _earlier(path)  # refused before the command runs, replaced once it has
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.recording-", dir=path.parent))
    try:
        site = staging / SITE_FOLDER
        site.mkdir()
        (site / "sitecustomize.py").write_text(_SHIM, encoding="utf-8")
        env = dict(os.environ)
        env[RECORD_ENV] = str(staging)
        env[RUN_ENV] = secrets.token_hex(16)
        if steps is not None:
            env[STEPS_ENV] = steps_text(steps)
        if portable_random is not None and portable_random is not False:
            env[PORTABLE_ENV] = portable_text(portable_random)
        rest = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = str(site) + (os.pathsep + rest if rest else "")
        sys.stderr.write(f"detctx record: {' '.join(command)}\n")
        try:
            status = _run(command, env)
        except (KeyboardInterrupt, Stopped):
            sys.stderr.write(f"detctx record: stopped; nothing written to {shown}\n")
            raise
        ranks = sorted(staging.glob("rank*.trace"))
        if status != 0:
            for trace in ranks or [staging / "main.trace"]:
                if trace.is_file():
                    _mark_failed(trace, status)
        empty = [
            trace.name if ranks else str(shown)
            for trace in (ranks or [staging / "main.trace"])
            if trace.is_file() and _ops_in(trace) == 0
        ]
        if ranks:
            _replace_earlier(path)
            path.mkdir()
            for trace in ranks:
                trace.rename(path / trace.name)
            written = f"{len(ranks)} rank traces in {shown}"
        elif (staging / "main.trace").is_file():
            _replace_earlier(path)
            (staging / "main.trace").rename(path)
            written = f"trace written to {shown}"
        else:
            raise TraceError(
                "the command wrote no trace: detctx record records the Python processes it "
                "starts through a sitecustomize on PYTHONPATH; this command started none that "
                "could import detctx (not Python, python -I or -S, or another environment)"
            )
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # detctx made it, and all in it
    if status != 0:
        sys.stderr.write(f"detctx: error: the command exited with status {status}; {written}\n")
        return 2
    if empty:
        sys.stderr.write(f"detctx: error: {written}, but {', '.join(empty)} holds no op: ")
        if steps is not None:
            sys.stderr.write(
                f"the window of steps {steps_text(steps)} never opened: the command completed "
                f"fewer than {steps[0]} optimizer steps (optimizer.step() calls) in the "
                "process recorded (or, on torch 2.1, torch.compile ran first: TorchDynamo then "
                "stops torch's global optimizer step hooks, which count the steps)\n"
            )
        else:
            sys.stderr.write(_UNRECORDED + "\n")
        return 2
    print(written)
    return 0


def _run(command: list[str], env: dict[str, str]) -> int:
    """Run ``command`` in its own process group to its end, then stop what it left running;
    its exit status. Stopped with its signal when ``detctx record`` is."""
    run_id = mark_run(env)
    with forwarded_signals():
        try:
            process = subprocess.Popen(command, env=env, start_new_session=True)
        except OSError as exc:
            raise TraceError(f"cannot start {command[0]}: {exc.strerror or exc}") from None
        try:
            wait_for_exit(process)
            # A process the command left running may still be recording into the staging
            # folder: it goes before the traces are moved.
            left = stop_run(process, run_id, int(signal.SIGTERM))
        except BaseException as exc:
            stop_run(process, run_id, signal_of(exc))
            raise
    if left:
        count = f"{len(left)} process" + ("" if len(left) == 1 else "es")
        shown = ", ".join(map(str, left[:10])) + (", ..." if len(left) > 10 else "")
        sys.stderr.write(
            f"detctx record: the command exited and left {count} running (pid {shown}); "
            f"stopped with SIGTERM (SIGKILL for any still there after {GRACE_S:g} s)\n"
        )
    return process.returncode


def _end_of(trace: Path) -> tuple[int, dict[str, Any]] | None:
    """Where a complete trace's end chunk starts, and what it holds; ``None`` when it has
    none (a trace cut short, which the compare reports)."""
    try:
        with open(trace, "rb") as stream:
            size = stream.seek(0, os.SEEK_END)
            stream.seek(max(0, size - _TAIL))
            tail = stream.read()
    except OSError:
        return None
    for start in range(len(tail) - _CHUNK.size, -1, -1):
        kind, length, crc = _CHUNK.unpack_from(tail, start)
        payload = tail[start + _CHUNK.size :]
        if kind == b"E" and length == len(payload) and zlib.crc32(payload) == crc:
            try:
                end = json.loads(payload)
            except ValueError:
                return None
            return (size - len(tail) + start, end) if isinstance(end, dict) else None
    return None


def _ops_in(trace: Path) -> int | None:
    """How many ops a complete trace holds, read from its end chunk; ``None`` when it has
    none."""
    found = _end_of(trace)
    try:
        return int(found[1]["rows"][0]) if found is not None else None
    except (KeyError, TypeError, IndexError, ValueError):
        return None


def _mark_failed(trace: Path, status: int) -> None:
    """A trace whose process ran to its end in a command that failed says so: its end
    chunk's outcome becomes the command's exit (a process that called ``sys.exit(1)``
    closed it as completed; only the command's status tells)."""
    found = _end_of(trace)
    if found is None or found[1].get("outcome") != _COMPLETED:
        return  # cut short, or it already says how it ended
    start, end = found
    ended = f"signal {-status}" if status < 0 else f"status {status}"
    end["outcome"] = f"the command exited with {ended}"
    payload = json.dumps(end).encode()
    with open(trace, "r+b") as stream:
        stream.seek(start)
        stream.write(_CHUNK.pack(b"E", len(payload), zlib.crc32(payload)) + payload)
        stream.truncate()


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tolerance is a number, not {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"a tolerance is a finite number >= 0, not {text!r}")
    return value


def _window(text: str) -> tuple[int, int]:
    try:
        return parse_steps(text)
    except TraceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _portable(text: str) -> int | bool:
    try:
        return parse_portable(text, "--portable-random")
    except TraceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(commands: Any, compare: argparse.ArgumentParser) -> None:
    """``detctx record``, and ``compare``'s options for traces."""
    parser = commands.add_parser(
        "record",
        help="run a command once, recording every op's statistics for detctx compare",
        usage="detctx record -o PATH [--steps A:B] [--portable-random [SEED]] -- CMD ...",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="PATH",
        help="the trace to write (a folder of rank<N>.trace files when CMD starts ranks)",
    )
    parser.add_argument(
        "--steps",
        type=_window,
        metavar="A:B",
        help="record only optimizer steps A to B-1 (counted as optimizer.step() calls "
        "complete), after the state step A starts from",
    )
    parser.add_argument(
        "--portable-random",
        nargs="?",
        const=True,
        type=_portable,
        metavar="SEED",
        help="draw every random op (dropout's masks, randn, randint, ...) from a generator "
        "that gives the same bits on every device and torch release, keyed by SEED (an "
        "integer in [0, 2**64); alone: torch.initial_seed() as recording starts, torch's "
        "default seed), so two environments draw the same and the compare sees past them. "
        "The run draws other numbers than without it; random ops it does not cover "
        "(multinomial, poisson, ...) stop the run with an error",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    parser.set_defaults(command_parser=parser)
    for flag in ("--rtol", "--atol"):
        compare.add_argument(
            flag,
            type=_tolerance,
            metavar="X",
            help=f"traces: {flag[2:]} for every float dtype (default: per dtype)",
        )
    compare.add_argument("--json", action="store_true", help="traces: print the result as JSON")


def dispatch(args: argparse.Namespace) -> int | None:
    """Run ``record``, or ``compare`` on traces; ``None`` for a compare of metric logs."""
    if args.command == "record":
        command = list(args.cmd)
        if command and command[0] == "--":
            command = command[1:]
        if not command:
            args.command_parser.error(
                "record needs a command after --, e.g. detctx record "
                "-o run.trace -- python train.py"
            )
        return record(args.output, command, args.steps, portable_random=args.portable_random)
    traces = [looks_like_trace(path) for path in args.logs]
    if any(traces):
        if not all(traces):
            trace, other = args.logs if traces[0] else args.logs[::-1]
            raise TraceError(
                f"{trace} is a recorded trace but {other} is not: compare two "
                "traces (detctx record) or two metric logs"
            )
        return compare_recorded(
            args.logs[0],
            args.logs[1],
            rtol=args.rtol,
            atol=args.atol,
            as_json=args.json,
            plot_path=args.plot,
        )
    if args.rtol is not None or args.atol is not None or args.json:
        raise ValueError("--rtol, --atol and --json compare recorded traces, not metric logs")
    return None
