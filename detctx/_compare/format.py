"""Statistics traces on disk: a header with the environment, then checked chunks of rows.

A trace is :data:`MAGIC`, a format version, a JSON header (the environment,
the run it belongs to and the sketch's shape) with its CRC-32, then chunks.
A chunk is a kind byte, its length and CRC-32, a JSON prefix (the strings
first used in it, its row counts) and three arrays of fixed-size
little-endian rows: ops (:data:`OP`: name, module path, source line, autograd
node and scalar arguments as string numbers, counts and digest), their
outputs' statistics and digests
(:data:`VALUE`) and their inputs' producers (:data:`INPUT`, the data flow; the
digest of an input no recorded op made).
An end chunk holds the totals and how the recorded block ended
(:data:`COMPLETED`, or the exception that left it), so a trace cut short (a
run killed before it closed it) is told from a complete one, and a run that
raised from one that ran to its end.
Nothing in it depends on the torch release that wrote it: names are
strings, numbers are NumPy rows.

Traces are untrusted input: :mod:`detctx._compare.reading` checks every
byte of one read back.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Final

import numpy as np

from detctx._compare.sketch import COLUMNS, FOLDS, KEY, SIGNS, SKETCH, STATISTICS

__all__ = [
    "CHUNK",
    "COMPLETED",
    "FORMAT",
    "INPUT",
    "MAGIC",
    "MAX_OUTCOME",
    "MAX_STRING",
    "OP",
    "PREFIX",
    "READ_OP",
    "SKETCH_SHAPE",
    "START",
    "STATE_OP",
    "UNSHARED",
    "VALUE",
    "VERSION",
    "Inputs",
    "Trace",
    "TraceWriter",
    "Unseen",
]

MAGIC: Final = b"DETCTXST"
VERSION: Final = 5
COMPLETED: Final = "completed"
"""The outcome of a recording whose block (or process) ran to its end."""
UNSHARED: Final = "unshared"
"""The run identity of a rank that had no way to learn one its peers share."""
STATE_OP: Final = "detctx::state"
"""The op name of a row holding one tensor of the state a window of steps starts from (its
source: ``[parameter NAME]``, ``[buffer NAME]``, ``[NAME: exp_avg]``)."""
READ_OP: Final = "detctx::read"
"""The op name of a row holding a parameter or buffer no recorded op made, where an op first
reads it (its source: ``[parameter NAME]``, ``[buffer NAME]``)."""
FORMAT: Final = "detctx statistics trace"
OP: Final = np.dtype(
    [
        ("op", "<u4"),
        ("module", "<u4"),
        ("source", "<u4"),
        ("node", "<u4"),
        ("scalars", "<u4"),
        ("outputs", "<u4"),
        ("inputs", "<u4"),
        ("high", "<u8"),
        ("low", "<u8"),
    ]
)
VALUE: Final = np.dtype(
    [
        ("dtype", "<u4"),
        ("shape", "<u4"),
        ("high", "<u8"),
        ("low", "<u8"),
        ("stats", "<f8", (len(STATISTICS) + SKETCH,)),
    ]
)
Inputs = list[tuple[int, int]]
"""Each input's producer: the op and output that last wrote its memory, or ``(-1, 0)``."""
Unseen = tuple[tuple[int, int], ...]
"""The digests of an op's inputs no recorded op made: ``(place among its inputs, digest)``."""
INPUT: Final = np.dtype([("op", "<i8"), ("output", "<u4"), ("high", "<u8"), ("low", "<u8")])
"""An input: the op and output that made it (``op`` -1: no recorded op), and for data no
recorded op made that the op reads (the batch, memory allocated unseen), its digest (0 where
it has a producer, or where its bits are not known)."""
START: Final = struct.Struct("<8sIII")
"""Magic, version, the header's length and its CRC-32."""
CHUNK: Final = struct.Struct("<cQI")
"""A chunk's kind, length and CRC-32."""
PREFIX: Final = struct.Struct("<I")
SKETCH_SHAPE: Final = [SIGNS, COLUMNS, FOLDS, KEY]
"""What the header says of the sketch; a reader refuses any other."""
MAX_STRING: Final = 4096
MAX_OUTCOME: Final = 1024
_ROWS: Final = 4096
_WORD: Final = 2**64 - 1


class TraceWriter:
    """Writes rows to ``path`` a chunk at a time; :meth:`close` writes the end chunk."""

    def __init__(self, path: Path, header: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        # Unbuffered: a forked child that abandons the trace has no buffer to flush at exit.
        self._file: BinaryIO | None = open(path, "xb", buffering=0)
        # The header is read when the first op is recorded (or at close): by then the
        # program has set its determinism switches, which `detctx record` starts before.
        self._header: Callable[[], dict[str, Any]] | None = header
        self._strings: dict[str, int] = {}
        self._new: list[str] = []
        self._ops: list[tuple[int, ...]] = []
        self._values: list[tuple[int, int, int, np.ndarray]] = []
        self._inputs: list[tuple[int, int]] = []
        self._unseen: list[tuple[int, int]] = []
        self.totals = [0, 0, 0]

    def string(self, text: str) -> int:
        number = self._strings.get(text)
        if number is None:
            number = self._strings[text] = len(self._strings)
            self._new.append(text[:MAX_STRING])
        return number

    def add(
        self,
        where: tuple[int, int, int, int, int],
        digest: int,
        values: list[tuple[int, int, int, np.ndarray]],
        inputs: Inputs,
        unseen: Unseen = (),
    ) -> None:
        """One op: its (op, module, source, node, scalar arguments) strings, digest,
        outputs (dtype and shape strings, digest, row), producers, and the digests of
        inputs without one (``(place among its inputs, digest)``)."""
        if self._header is not None:
            self._write_header()
        self._ops.append((*where, len(values), len(inputs), digest >> 64, digest & _WORD))
        self._values.extend(values)
        for place, read in unseen:
            self._unseen.append((len(self._inputs) + place, read))
        self._inputs.extend(inputs)
        if len(self._ops) >= _ROWS:
            self.flush()

    def begin(self) -> None:
        """Write the header now (else the first :meth:`add` does)."""
        if self._header is not None:
            self._write_header()

    def _write_header(self) -> None:
        header, self._header = self._header, None
        if header is None or self._file is None:
            return
        text = json.dumps(
            {"format": FORMAT, "sketch": SKETCH_SHAPE, **header()}, sort_keys=True
        ).encode()
        self._file.write(START.pack(MAGIC, VERSION, len(text), zlib.crc32(text)) + text)

    def flush(self) -> None:
        if self._file is None or not (self._ops or self._new):
            return
        ops = np.array(self._ops, dtype=np.uint64).reshape(-1, 9)
        op_rows = np.zeros(len(ops), dtype=OP)
        for column, name in enumerate(OP.names or ()):
            op_rows[name] = ops[:, column]
        value_rows = np.zeros(len(self._values), dtype=VALUE)
        if self._values:
            value_rows["dtype"] = [value[0] for value in self._values]
            value_rows["shape"] = [value[1] for value in self._values]
            value_rows["high"] = [value[2] >> 64 for value in self._values]
            value_rows["low"] = [value[2] & _WORD for value in self._values]
            value_rows["stats"] = np.stack([value[3] for value in self._values])
        input_rows = np.zeros(len(self._inputs), dtype=INPUT)
        if self._inputs:
            made = np.array(self._inputs, dtype=np.int64).reshape(-1, 2)
            input_rows["op"], input_rows["output"] = made[:, 0], made[:, 1]
        for row, read in self._unseen:
            input_rows["high"][row], input_rows["low"][row] = read >> 64, read & _WORD
        counts = [len(op_rows), len(value_rows), len(input_rows)]
        prefix = json.dumps({"strings": self._new, "rows": counts}).encode()
        payload = b"".join(
            [
                PREFIX.pack(len(prefix)),
                prefix,
                op_rows.tobytes(),
                value_rows.tobytes(),
                input_rows.tobytes(),
            ]
        )
        self._write(b"B", payload)
        self.totals = [total + count for total, count in zip(self.totals, counts)]
        self._new, self._ops, self._values, self._inputs, self._unseen = [], [], [], [], []

    def _write(self, kind: bytes, payload: bytes) -> None:
        assert self._file is not None
        self._file.write(CHUNK.pack(kind, len(payload), zlib.crc32(payload)) + payload)

    def abandon(self) -> None:
        """Write nothing more (a forked child's copy of the writer)."""
        self._file = None
        self._ops, self._values, self._inputs, self._new, self._unseen = [], [], [], [], []

    def cut(self) -> None:
        """Close the file without its end chunk: it reads as a trace cut short."""
        file = self._file
        self.abandon()
        if file is not None:
            file.close()

    def close(self, outcome: str = COMPLETED) -> None:
        """Write what is left and the end chunk: the totals and ``outcome`` (how the recorded
        block ended: :data:`COMPLETED`, or what it raised)."""
        if self._file is None:
            return
        try:
            self._write_header()
            self.flush()
            end = {"rows": self.totals, "outcome": outcome[:MAX_OUTCOME]}
            self._write(b"E", json.dumps(end).encode())
        finally:
            self._file.close()
            self._file = None


class Trace:
    """A trace read back: environment, strings and the three row arrays, all checked."""

    def __init__(
        self,
        path: Path,
        header: dict[str, Any],
        strings: list[str],
        ops: np.ndarray,
        values: np.ndarray,
        inputs: np.ndarray,
    ) -> None:
        self.path = path
        self.header = header
        self.environment: dict[str, Any] = header["environment"]
        self.run: str = header["run"]
        self.outcome = COMPLETED
        self.strings = strings
        self.ops = ops
        self.values = values
        self.inputs = inputs
        self.first_value = np.concatenate([[0], np.cumsum(ops["outputs"], dtype=np.int64)])
        self.first_input = np.concatenate([[0], np.cumsum(ops["inputs"], dtype=np.int64)])

    def __len__(self) -> int:
        return len(self.ops)

    def text(self, number: int) -> str:
        return self.strings[number]
