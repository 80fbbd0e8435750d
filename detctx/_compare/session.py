"""``detctx.recording(path)`` and the recording ``detctx record`` starts in each process.

One process writes one trace. Under torchrun (``$WORLD_SIZE`` above 1, or an
initialised process group of several ranks) ``path`` is a folder and each
rank writes ``rank<N>.trace`` into it, so the traces of one run compare
rank by rank with another's.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from detctx._compare.environment import environment, rank_and_world
from detctx._compare.format import TraceWriter
from detctx._compare.recorder import StatisticsRecorder
from detctx._locate import record_until_exit

__all__ = ["RECORD_ENV", "recording", "start_from_environment"]

RECORD_ENV: Final = "DETCTX_RECORD_DIR"
"""The folder ``detctx record`` has each process of its command record into."""


def _open(path: Path, rank: int, world: int) -> TraceWriter:
    return TraceWriter(
        path, lambda: {"environment": environment(), "rank": rank, "world_size": world}
    )


def trace_path(path: str | os.PathLike[str]) -> Path:
    """Where this process writes: ``path``, or ``path/rank<N>.trace`` among several ranks."""
    target = Path(path)
    rank, world = rank_and_world()
    if world > 1:
        target.mkdir(parents=True, exist_ok=True)
        return target / f"rank{rank}.trace"
    if target.is_dir():
        raise IsADirectoryError(
            f"{target} is a folder: a single process records into a file (a folder of "
            "rank<N>.trace files is written under torchrun)"
        )
    return target


@contextlib.contextmanager
def recording(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Record every op run inside the block, with statistics, into the trace at ``path``.

    ``detctx compare`` (or :func:`detctx.compare_traces`) then compares it with a trace
    of the same program recorded elsewhere: another device, torch release, kernel
    library or number of ranks. An existing file at ``path`` is replaced. Among
    several ranks ``path`` is a folder and each rank writes ``rank<N>.trace``.

    >>> with detctx.recording("a.trace"):   # doctest: +SKIP
    ...     train_step(model, batch)
    """
    target = trace_path(path)
    rank, world = rank_and_world()
    target.unlink(missing_ok=True)
    writer = _open(target, rank, world)
    recorder = StatisticsRecorder(writer)
    try:
        recorder.start()
        try:
            yield target
        finally:
            recorder.stop()
    finally:
        writer.close()


def start_from_environment() -> bool:
    """Start recording this process into ``$DETCTX_RECORD_DIR`` if it is set; whether it did.

    A rank of torchrun writes ``rank<N>.trace``; any other process writes
    ``main.trace`` if no process of the command has yet (the first one records, as
    ``detctx run --locate``'s). A file that exists already is left alone: a process
    spawned by a rank (a DataLoader worker) records nothing.
    """
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return False
    rank, world = rank_and_world()
    name = f"rank{rank}.trace" if world > 1 else "main.trace"
    try:
        writer = _open(Path(folder) / name, rank, world)
    except FileExistsError:
        return False
    except OSError as exc:
        sys.stderr.write(f"detctx: not recording this process: {exc.strerror or exc}\n")
        return False
    record_until_exit(StatisticsRecorder(writer), writer)
    return True
