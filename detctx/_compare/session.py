"""``detctx.recording(path)`` and the recording ``detctx record`` starts in each process.

One process writes one trace. Under torchrun (``$WORLD_SIZE`` above 1, or an
initialised process group of several ranks) ``path`` is a folder and each
rank writes ``rank<N>.trace`` into it, so the traces of one run compare
rank by rank with another's.

Each trace names the run it belongs to (:func:`run_identity`), so a folder
that mixes the ranks of two runs is refused, and says how the recorded block
ended: ran to its end, or what it raised (a trace of a run that failed never
agrees with anything).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import torch

from detctx._basics import (
    PORTABLE_ENV,
    STEPS_ENV,
    TraceError,
    parse_portable,
    parse_steps,
    portable_seed,
)
from detctx._compare.environment import environment, rank_and_world
from detctx._compare.format import COMPLETED, UNSHARED, TraceWriter
from detctx._compare.portable import PortableRandom
from detctx._compare.recorder import StatisticsRecorder
from detctx._locate import record_until_exit

__all__ = ["RECORD_ENV", "RUN_ENV", "recording", "run_identity", "start_from_environment"]

RECORD_ENV: Final = "DETCTX_RECORD_DIR"
"""The folder ``detctx record`` has each process of its command record into."""
RUN_ENV: Final = "DETCTX_RECORD_RUN"
"""The run identity ``detctx record`` hands every process of its command."""
_TORCHELASTIC_ID: Final = "TORCHELASTIC_RUN_ID"
_RECORDINGS: Final = itertools.count()
"""This process's recordings under a process group, numbered: the n-th of every rank
shares the identity the first of them put in the group's store."""


def _well_formed(text: str) -> bool:
    return 0 < len(text) <= 64 and text.isascii() and text.isprintable()


def run_identity(world: int) -> str:
    """The identity every rank of this run writes in its trace's header.

    In order: ``$DETCTX_RECORD_RUN`` (``detctx record`` sets it for every process it
    starts); with a process group of ``world`` ranks initialised as the recording starts,
    the first identity any rank puts in the group's store for this recording (each rank's
    n-th recording shares one; no rank waits for another, so a recording that only some
    ranks start cannot hang); torchrun's run id (``--standalone`` draws one per run;
    ``--rdzv-id`` names it) with its restart count; a fresh random one for a single
    process. A rank with none of these writes :data:`UNSHARED`, and the compare says that
    the folder's traces could not be checked to come from one run.
    """
    given = os.environ.get(RUN_ENV, "")
    if _well_formed(given):
        return given
    if world == 1:
        return secrets.token_hex(16)
    shared = _from_group_store(world)
    if shared is not None:
        return shared
    elastic = os.environ.get(_TORCHELASTIC_ID, "")
    if elastic and elastic != "none":
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        identity = f"torchrun {elastic} restart {restart}"
        if _well_formed(identity):
            return identity
    return UNSHARED


def _from_group_store(world: int) -> str | None:
    distributed = getattr(torch, "distributed", None)
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return None
    if distributed.get_world_size() != world:
        return None
    try:
        # Private but present from torch 2.1 on; compare_set puts a value only where none
        # is, and returns the one there.
        from torch.distributed.distributed_c10d import _get_default_store

        key = f"detctx/recording/{next(_RECORDINGS)}"
        value = _get_default_store().compare_set(key, "", secrets.token_hex(16))
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return None
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    return text if _well_formed(text) else None


def _open(path: Path, rank: int, world: int, run: str, seed: int | None) -> TraceWriter:
    # A portable seed is part of the environment: two recordings that draw their random
    # ops otherwise (one portable, one not; two seeds) say so among its differences.
    portable = {} if seed is None else {"portable_random": seed}
    return TraceWriter(
        path,
        lambda: {
            "environment": {**environment(), **portable},
            "rank": rank,
            "run": run,
            "world_size": world,
        },
    )


def _recorder(
    writer: TraceWriter, window: tuple[int, int] | None, seed: int | None
) -> StatisticsRecorder:
    portable = None if seed is None else PortableRandom(seed)
    return StatisticsRecorder(writer, window, portable=portable)


def _outcome(error: BaseException) -> str:
    """How a recorded block that raised ``error`` ended, as its trace says it."""
    text = f"raised {type(error).__name__}"
    detail = str(error).splitlines()[0] if str(error) else ""
    return f"{text}: {detail}" if detail else text


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
def recording(
    path: str | os.PathLike[str], *, steps: object = None, portable_random: bool | int | None = None
) -> Iterator[Path]:
    """Record every op run inside the block, with statistics, into the trace at ``path``.

    ``detctx compare`` (or :func:`detctx.compare_traces`) then compares it with a trace
    of the same program recorded elsewhere: another device, torch release, kernel
    library or number of ranks. An existing file at ``path`` is replaced. Among
    several ranks ``path`` is a folder and each rank writes ``rank<N>.trace``.

    ``steps``: a window of optimizer steps, ``"A:B"``, ``(A, B)`` or ``range(A, B)``:
    only the ops of steps ``A`` to ``B - 1`` are recorded (steps counted as
    ``optimizer.step()`` calls complete, of any optimizer, from the block's start),
    and before them the state step ``A`` starts from: each parameter and buffer of
    the modules called so far and each tensor of the optimizers' state. Two windows
    that start from different states differ there, and the compare says so.

    ``portable_random``: ``True`` or a seed in ``[0, 2**64)`` makes every random op in
    the block (dropout's masks, ``randn``, ``randint``, ...; recorded or not) draw from a
    generator that gives the same bits on every device and torch release, keyed by the
    seed (``True``: ``torch.initial_seed()`` when the block starts) and the op's place
    among the block's random ops, so two environments draw the same masks and the
    compare sees past them. The block then draws other numbers than it would without it
    (for comparing environments, not for the run's results); torch's generators are not
    advanced, a ``generator=`` argument is ignored, and a random op it does not cover
    (``multinomial``, ``poisson``, ...) raises :class:`~detctx.TraceError` before it
    runs. ``None`` or ``False``: off.

    >>> with detctx.recording("a.trace"):   # doctest: +SKIP
    ...     train_step(model, batch)
    >>> with detctx.recording("b.trace", portable_random=1234):   # doctest: +SKIP
    ...     train_step(model, batch)
    """
    window = None if steps is None else parse_steps(steps)
    seed = portable_seed(portable_random, torch.initial_seed)
    target = trace_path(path)
    rank, world = rank_and_world()
    run = run_identity(world)
    target.unlink(missing_ok=True)
    writer = _open(target, rank, world, run, seed)
    recorder = _recorder(writer, window, seed)
    outcome = COMPLETED
    try:
        recorder.start()
        try:
            yield target
        except BaseException as error:
            outcome = _outcome(error)
            raise
        finally:
            recorder.stop()
    finally:
        writer.close(outcome)


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
    window, seed = None, None
    if os.environ.get(STEPS_ENV):
        try:
            window = parse_steps(os.environ[STEPS_ENV])
        except TraceError as exc:
            sys.stderr.write(f"detctx: not recording this process: ${STEPS_ENV}: {exc}\n")
            return False
    if os.environ.get(PORTABLE_ENV):
        try:  # the message names the variable
            seed = portable_seed(parse_portable(os.environ[PORTABLE_ENV]), torch.initial_seed)
        except TraceError as exc:
            sys.stderr.write(f"detctx: not recording this process: {exc}\n")
            return False
    rank, world = rank_and_world()
    name = f"rank{rank}.trace" if world > 1 else "main.trace"
    try:
        writer = _open(Path(folder) / name, rank, world, run_identity(world), seed)
    except FileExistsError:
        return False
    except OSError as exc:
        sys.stderr.write(f"detctx: not recording this process: {exc.strerror or exc}\n")
        return False
    record_until_exit(_recorder(writer, window, seed), _ClosedAtExit(writer))
    return True


class _ClosedAtExit:
    """Closes a whole process's trace with how the process ended: an exception the
    interpreter printed (``sys.last_exc``, ``sys.last_value`` before Python 3.12) or its end.
    An exit status other than 0 without one (``sys.exit(1)``) is not seen here; ``detctx
    record`` marks the traces of a command that exited so."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer

    def close(self) -> None:
        error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        self.writer.close(_outcome(error) if isinstance(error, BaseException) else COMPLETED)
