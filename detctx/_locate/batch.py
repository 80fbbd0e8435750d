"""Recorded ops as rows of numbers: what a recorder hands its sink, a batch at a time.

A recorder names each op by three numbers: the op, the place that ran it
(module path, source line, autograd node) and the description of its first
output (dtype, shape, device). The numbers index tables shared by every
recorder in the process, so two runs recorded in one process compare by
number, and a batch of ops compares in a few vectorised calls.
:class:`RowWriter` and :class:`RowReader` keep a run's rows in a file, for a
later run of the same process to compare with; :class:`Batch.record` turns a
row back into an :class:`~detctx._locate.trace.OpRecord` of strings.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Final

import numpy as np
import torch

from detctx._basics import TraceError
from detctx._locate.trace import OpRecord

__all__ = [
    "COMPARED",
    "ROW",
    "Batch",
    "RowReader",
    "RowWriter",
    "meta_number",
    "op_number",
    "site_number",
]

ROW: Final = np.dtype(
    [
        ("op", "<i4"),
        ("site", "<i4"),
        ("meta", "<i4"),
        ("random", "u1"),
        ("rng", "<u8"),
        ("high", "<u8"),
        ("low", "<u8"),
    ]
)
"""One op: its numbers, whether it drew random numbers (and the generator's state
digest before it did), and the 128-bit digest of its outputs in two halves."""

READ_AHEAD: Final = 1024
"""Rows a :class:`RowReader` reads from its file at a time, at least."""
_NAMES: Final = ("op", "site", "meta", "random", "rng", "high", "low")
_lock = threading.Lock()


def _fresh_lock_in_child() -> None:
    # A child forked while another thread numbered a value would wait for that thread.
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_fresh_lock_in_child)


class _Table:
    """Values numbered in the order they are first seen, shared by every recorder."""

    def __init__(self, describe: Callable[[Any], Any]) -> None:
        self.values: list[Any] = []
        self._numbers: dict[Any, int] = {}
        self._describe = describe

    def number(self, key: Any) -> int:
        number = self._numbers.get(key)
        if number is None:
            with _lock:
                number = self._numbers.setdefault(key, len(self.values))
                if number == len(self.values):
                    self.values.append(self._describe(key))
        return number


def _describe_meta(
    key: tuple[torch.dtype, tuple[int, ...], torch.device],
) -> tuple[str, tuple[int, ...], str]:
    dtype, shape, device = key
    return (str(dtype).removeprefix("torch."), tuple(shape), str(device))


_ops = _Table(str)
_sites = _Table(tuple)
_metas = _Table(_describe_meta)


def op_number(name: str) -> int:
    """The number of the op named ``name`` (``aten::addmm``), the same for every recorder."""
    return _ops.number(name)


def site_number(module_path: str, source: str, node: str) -> int:
    """The number of a place: module path, ``file:line`` and autograd node (``""`` if none)."""
    return _sites.number((module_path, source, node))


def site(number: int) -> tuple[str, str, str]:
    """The module path, source line and node of place ``number``."""
    found: tuple[str, str, str] = _sites.values[number]
    return found


def meta_number(dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> int:
    """The number of an output description: dtype, shape, device."""
    return _metas.number((dtype, shape, device))


def row_record(row: np.void) -> OpRecord:
    """A row (of a batch, or read back by a :class:`RowReader`) as an
    :class:`~detctx._locate.trace.OpRecord`."""
    return _record_of(tuple(int(row[name]) for name in _NAMES))


def _record_of(values: tuple[int, ...]) -> OpRecord:
    op, where, meta, random, rng, high, low = values
    tables = ((op, _ops), (where, _sites), (meta, _metas))
    if not all(0 <= number < len(table.values) for number, table in tables):
        raise TraceError(f"a recorded op refers to an unknown number ({op}, {where}, {meta})")
    return OpRecord.of(
        _ops.values[op], _sites.values[where], _metas.values[meta], high, low, rng, bool(random)
    )


class Batch:
    """Consecutive recorded ops, from op number :attr:`first` of the run on.

    ``rows`` is a :data:`ROW` array. ``tensors(i)`` gives copies of op
    ``first + i``'s outputs as they were when it ran, where the recorder
    still has them (``None`` otherwise); it can be called only while the
    sink's ``add_batch`` runs.
    """

    def __init__(
        self,
        first: int,
        rows: np.ndarray,
        tensors: Callable[[int], list[torch.Tensor] | None],
    ) -> None:
        self.first = first
        self.rows = rows
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.rows)

    def record(self, position: int) -> OpRecord:
        """Op ``first + position`` as an :class:`~detctx._locate.trace.OpRecord`."""
        return row_record(self.rows[position])

    def records(self) -> list[OpRecord]:
        return [_record_of(values) for values in self.rows.tolist()]


COMPARED: Final = ("op", "meta", "random", "rng", "high", "low")
"""What two runs must agree on, op by op (not the place: a run may reach the same op
from another line and still compute the same)."""


def first_difference(rows: np.ndarray, reference: np.ndarray) -> int | None:
    """The position of the first row that differs from ``reference``'s (same lengths)."""
    differs = np.zeros(len(rows), dtype=bool)
    for name in COMPARED:
        differs |= rows[name] != reference[name]
    if not differs.any():
        return None
    return int(np.argmax(differs))


class RowWriter:
    """A sink that writes a run's rows to ``path``, for a later run of this process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO | None = open(path, "xb")
        self.count = 0

    def add_batch(self, batch: Batch) -> None:
        if self._file is None:
            raise ValueError(f"the rows file {self.path} is closed")
        self._file.write(batch.rows.tobytes())
        self.count += len(batch)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RowReader:
    """Reads back a :class:`RowWriter`'s rows in order, ``count`` of them.

    :meth:`take` hands out the next rows; :meth:`peek` looks at a row ahead
    of them (read from the file and kept until taken).
    """

    def __init__(self, path: Path, count: int) -> None:
        self.path = path
        self.count = count
        self._file: BinaryIO | None = open(path, "rb")
        self._ahead = np.empty(0, dtype=ROW)
        self._position = 0  # the number of the first row in _ahead

    def _read(self, upto: int) -> None:
        """Have rows up to (not including) ``upto`` in memory, or every row left; rows are
        read :data:`READ_AHEAD` at a time at least (a peek per op would read one)."""
        upto = min(upto, self.count)
        missing = upto - (self._position + len(self._ahead))
        if missing <= 0 or self._file is None:
            return
        wanted = min(max(missing, READ_AHEAD), self.count - self._position - len(self._ahead))
        data = self._file.read(wanted * ROW.itemsize)
        if len(data) != wanted * ROW.itemsize:
            raise TraceError(
                f"the rows file {self.path} is shorter than the {self.count} rows written"
            )
        self._ahead = np.concatenate((self._ahead, np.frombuffer(data, dtype=ROW)))

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` rows (fewer once the run's rows run out)."""
        self._read(self._position + count)
        rows, self._ahead = self._ahead[:count], self._ahead[count:]
        self._position += len(rows)
        return rows

    def peek(self, number: int) -> np.void | None:
        """Row ``number`` (not yet taken), or ``None`` past the last."""
        if number < self._position or number >= self.count:
            return None
        self._read(number + 1)
        row: np.void = self._ahead[number - self._position]
        return row

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
