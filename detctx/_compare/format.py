"""Statistics traces on disk: a header with the environment, then checked chunks of rows.

A trace is :data:`MAGIC`, a format version, a JSON header (the environment,
the run it belongs to and the sketch's shape) with its CRC-32, then chunks.
A chunk is a kind byte, its length and CRC-32, a JSON prefix (the strings
first used in it, its row counts) and three arrays of fixed-size
little-endian rows: ops (:data:`OP`), their outputs' statistics and digests
(:data:`VALUE`) and their inputs' producers (:data:`INPUT`, the data flow).
An end chunk holds the totals and how the recorded block ended
(:data:`COMPLETED`, or the exception that left it), so a trace cut short (a
run killed before it closed it) is told from a complete one, and a run that
raised from one that ran to its end.
Nothing in it depends on the torch release that wrote it: names are
strings, numbers are NumPy rows.

Traces are untrusted input: :func:`read_trace` checks every byte (lengths,
CRCs, every string and row number, every producer being an earlier op, every
statistic being one an output can have) and raises :class:`~detctx.TraceError`
naming the file and byte offset. Reading one holds about twice its size in
memory, nothing more.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Final

import numpy as np

from detctx._basics import TraceError
from detctx._compare.sketch import COLUMNS, FOLDS, KEY, SIGNS, SKETCH, STATISTICS, sketch_bound

__all__ = [
    "COMPLETED",
    "INPUT",
    "MAGIC",
    "OP",
    "UNSHARED",
    "VALUE",
    "Trace",
    "TraceWriter",
    "is_trace",
    "read_trace",
]

MAGIC: Final = b"DETCTXST"
VERSION: Final = 2
COMPLETED: Final = "completed"
"""The outcome of a recording whose block (or process) ran to its end."""
UNSHARED: Final = "unshared"
"""The run identity of a rank that had no way to learn one its peers share."""
FORMAT: Final = "detctx statistics trace"
OP: Final = np.dtype(
    [
        ("op", "<u4"),
        ("module", "<u4"),
        ("source", "<u4"),
        ("node", "<u4"),
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
INPUT: Final = np.dtype([("op", "<i8"), ("output", "<u4")])
_START: Final = struct.Struct("<8sIII")
_CHUNK: Final = struct.Struct("<cQI")
_PREFIX: Final = struct.Struct("<I")
_ROWS: Final = 4096
_MAX_HEADER: Final = 1 << 20
_MAX_STRING: Final = 4096
_MAX_OUTCOME: Final = 1024
MAX_BYTES: Final = 1 << 34
"""The largest trace read (16 GiB; it is held in memory while compared)."""
_SLACK: Final = 1e-5
"""Relative room for rounding in the checks between an output's statistics."""
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
        self.totals = [0, 0, 0]

    def string(self, text: str) -> int:
        number = self._strings.get(text)
        if number is None:
            number = self._strings[text] = len(self._strings)
            self._new.append(text[:_MAX_STRING])
        return number

    def add(
        self,
        where: tuple[int, int, int, int],
        digest: int,
        values: list[tuple[int, int, int, np.ndarray]],
        inputs: list[tuple[int, int]],
    ) -> None:
        """One op: its (op, module, source, node) strings, digest, outputs (dtype and shape
        strings, digest, row) and producers."""
        if self._header is not None:
            self._write_header()
        self._ops.append((*where, len(values), len(inputs), digest >> 64, digest & _WORD))
        self._values.extend(values)
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
            {"format": FORMAT, "sketch": [SIGNS, COLUMNS, FOLDS, KEY], **header()}, sort_keys=True
        ).encode()
        self._file.write(_START.pack(MAGIC, VERSION, len(text), zlib.crc32(text)) + text)

    def flush(self) -> None:
        if self._file is None or not (self._ops or self._new):
            return
        ops = np.array(self._ops, dtype=np.uint64).reshape(-1, 8)
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
        input_rows = np.array(self._inputs, dtype=INPUT)
        counts = [len(op_rows), len(value_rows), len(input_rows)]
        prefix = json.dumps({"strings": self._new, "rows": counts}).encode()
        payload = b"".join(
            [
                _PREFIX.pack(len(prefix)),
                prefix,
                op_rows.tobytes(),
                value_rows.tobytes(),
                input_rows.tobytes(),
            ]
        )
        self._write(b"B", payload)
        self.totals = [total + count for total, count in zip(self.totals, counts)]
        self._new, self._ops, self._values, self._inputs = [], [], [], []

    def _write(self, kind: bytes, payload: bytes) -> None:
        assert self._file is not None
        self._file.write(_CHUNK.pack(kind, len(payload), zlib.crc32(payload)) + payload)

    def abandon(self) -> None:
        """Write nothing more (a forked child's copy of the writer)."""
        self._file = None
        self._ops, self._values, self._inputs, self._new = [], [], [], []

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
            end = {"rows": self.totals, "outcome": outcome[:_MAX_OUTCOME]}
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


def is_trace(path: Path) -> bool:
    """Whether ``path`` is a statistics trace or a folder of them, by its header."""
    if path.is_dir():
        return any(is_trace(child) for child in sorted(path.glob("rank*.trace")))
    if not path.is_file():
        return False  # a FIFO would block the open
    try:
        with open(path, "rb") as stream:
            return stream.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _no_wait(path: str, flags: int) -> int:
    # A FIFO would block its reader until someone writes: opened without waiting, then
    # refused by fstat.
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


def read_trace(path: Path) -> Trace:
    """Read and check the trace at ``path``; :class:`~detctx.TraceError` when it is not one."""
    try:
        with open(path, "rb", opener=_no_wait) as stream:
            info = os.fstat(stream.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise TraceError(f"{path} is not a regular file: a trace is one")
            if info.st_size > MAX_BYTES:
                raise TraceError(f"{path} has {info.st_size} bytes, more than a trace may have")
            # As many bytes as the file has (and one more, to see it grow): a read of
            # MAX_BYTES would ask for that much memory up front, under `ulimit -v` too.
            data = stream.read(info.st_size + 1)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    return _Reader(Path(path), data).read()


class _Reader:
    def __init__(self, path: Path, data: bytes) -> None:
        self.path, self.data, self.at = path, data, 0

    def fail(self, why: str) -> TraceError:
        return TraceError(f"trace {self.path}: {why} at byte {self.at}; record it again")

    def take(self, size: int, what: str) -> bytes:
        if size > len(self.data) - self.at:
            raise self.fail(
                f"cut short in {what} (the run may have been killed before its trace was closed)"
            )
        part = self.data[self.at : self.at + size]
        self.at += size
        return part

    def json_of(self, raw: bytes, what: str) -> Any:
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise self.fail(f"its {what} is not JSON") from None

    def read(self) -> Trace:
        if len(self.data) < _START.size or self.data[: len(MAGIC)] != MAGIC:
            raise TraceError(f"{self.path} is not a detctx statistics trace (no header)")
        version = struct.unpack_from("<I", self.data, len(MAGIC))[0]
        if version != VERSION:
            raise TraceError(
                f"trace {self.path} is in format version {version}, this detctx reads "
                f"{VERSION}: record it again with this detctx"
            )
        _, _, size, crc = _START.unpack(self.take(_START.size, "the header"))
        if size > _MAX_HEADER:
            raise self.fail(f"a header of {size} bytes (at most {_MAX_HEADER})")
        raw = self.take(size, "the header")
        if zlib.crc32(raw) != crc:
            raise self.fail("a header whose CRC does not match (the file is damaged or edited)")
        header = self.json_of(raw, "header")
        self.check_header(header)
        strings: list[str] = []
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        totals = [0, 0, 0]
        while True:
            if self.at == len(self.data):
                raise self.fail(
                    "cut short: no end marker (the run may have been killed "
                    "before its trace was closed)"
                )
            kind, length, crc = _CHUNK.unpack(self.take(_CHUNK.size, "a chunk header"))
            start = self.at
            payload = self.take(length, "a chunk")
            if zlib.crc32(payload) != crc:
                self.at = start
                raise self.fail("a chunk whose CRC does not match (the file is damaged)")
            if kind == b"E":
                end = self.json_of(payload, "end marker")
                if not isinstance(end, dict) or end.get("rows") != totals:
                    raise self.fail("an end marker whose totals do not match the rows")
                outcome = end.get("outcome")
                if not isinstance(outcome, str) or not 0 < len(outcome) <= _MAX_OUTCOME:
                    raise self.fail("an end marker without the outcome of the run")
                if self.at != len(self.data):
                    raise self.fail("bytes after the end marker")
                break
            if kind != b"B":
                self.at = start
                raise self.fail(f"an unknown chunk kind {kind!r}")
            parts.append(self.chunk(payload, start, strings, totals))
        ops, values, inputs = (
            np.concatenate([part[k] for part in parts]) if parts else np.zeros(0, dtype)
            for k, dtype in enumerate((OP, VALUE, INPUT))
        )
        self.check_rows(ops, values, inputs, strings)
        trace = Trace(self.path, header, strings, ops, values, inputs)
        trace.outcome = outcome
        return trace

    def check_header(self, header: Any) -> None:
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise self.fail("a header that is not a statistics trace's")
        shape = [SIGNS, COLUMNS, FOLDS, KEY]
        if header.get("sketch") != shape:
            raise self.fail(f"a sketch of shape and key {header.get('sketch')!r}, not {shape}")
        run = header.get("run")
        if not isinstance(run, str) or not 0 < len(run) <= 64 or not run.isprintable():
            raise self.fail("a run identity that is not a short string")
        environment = header.get("environment")
        if not isinstance(environment, dict) or not all(
            isinstance(key, str) and (value is None or isinstance(value, (str, int, float)))
            for key, value in environment.items()
        ):
            raise self.fail("an environment that is not a table of names to plain values")
        for key in ("rank", "world_size"):
            if not isinstance(header.get(key), int) or header[key] < 0:
                raise self.fail(f"a {key} that is not a non-negative integer")
        if not header["rank"] < header["world_size"]:
            raise self.fail(f"rank {header['rank']} of a world of {header['world_size']}")

    def chunk(
        self, payload: bytes, start: int, strings: list[str], totals: list[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.at = start
        if len(payload) < _PREFIX.size:
            raise self.fail("a chunk too short for its prefix")
        (size,) = _PREFIX.unpack_from(payload)
        if size > len(payload) - _PREFIX.size:
            raise self.fail("a chunk prefix longer than its chunk")
        prefix = self.json_of(payload[_PREFIX.size : _PREFIX.size + size], "chunk prefix")
        new, counts = (
            (prefix.get("strings"), prefix.get("rows"))
            if isinstance(prefix, dict)
            else (None, None)
        )
        if not isinstance(new, list) or not all(
            isinstance(text, str) and len(text) <= _MAX_STRING for text in new
        ):
            raise self.fail("a chunk whose strings are not a list of short strings")
        if not (
            isinstance(counts, list)
            and len(counts) == 3
            and all(isinstance(c, int) and c >= 0 for c in counts)
        ):
            raise self.fail("a chunk whose row counts are not three non-negative integers")
        sizes = [count * dtype.itemsize for count, dtype in zip(counts, (OP, VALUE, INPUT))]
        if _PREFIX.size + size + sum(sizes) != len(payload):
            raise self.fail("a chunk whose length does not match its row counts")
        strings.extend(new)
        offset = _PREFIX.size + size
        arrays = []
        for count, dtype in zip(counts, (OP, VALUE, INPUT)):
            arrays.append(np.frombuffer(payload, dtype, count, offset))
            offset += count * dtype.itemsize
        for index, count in enumerate(counts):
            totals[index] += count
        self.at = start + len(payload)
        return arrays[0], arrays[1], arrays[2]

    def check_rows(
        self, ops: np.ndarray, values: np.ndarray, inputs: np.ndarray, strings: list[str]
    ) -> None:
        for name in ("op", "module", "source", "node"):
            if len(ops) and int(ops[name].max()) >= len(strings):
                raise self.fail(f"an op whose {name} names no string")
        if int(ops["outputs"].sum()) != len(values) or int(ops["inputs"].sum()) != len(inputs):
            raise self.fail("ops whose output or input counts do not add up to the rows")
        for name in ("dtype", "shape"):
            if len(values) and int(values[name].max()) >= len(strings):
                raise self.fail(f"an output whose {name} names no string")
        if len(values):
            self.check_statistics(values, strings)
        if len(inputs):
            owner = np.repeat(np.arange(len(ops)), ops["inputs"].astype(np.int64))
            producer = inputs["op"]
            if ((producer < -1) | (producer >= owner)).any():
                raise self.fail("an input said to come from an op that did not run before it")
            made = producer >= 0
            if (inputs["output"][made] >= ops["outputs"][producer[made]]).any():
                raise self.fail("an input said to be an output its producer does not have")

    def check_statistics(self, values: np.ndarray, strings: list[str]) -> None:
        """Every output's statistics are ones an output of its shape can have: counts that are
        counts and match the shape, finite min <= max with the mean between them, a norm
        within what its largest value allows, a sketch within its bound; all zero for an
        output without finite values. A crafted NaN, Inf or min > max is refused here rather
        than compared."""
        stats = values["stats"]
        # An output whose values could not be read (sparse, meta, quantized) is all NaN
        # past its counts, which are zero: nothing else may hold a NaN.
        unread = (stats[:, :3] == 0).all(axis=1) & np.isnan(stats[:, 3:]).all(axis=1)
        stats = stats[~unread]
        values = values[~unread]
        counts = stats[:, :3]
        if (
            not np.isfinite(counts).all()
            or (counts < 0).any()
            or (counts != np.floor(counts)).any()
            or (counts[:, 1:].sum(axis=1) > counts[:, 0]).any()
        ):
            raise self.fail("an output whose element, NaN or Inf counts are not counts")
        expected = {
            (int(dtype), int(shape)): _numbers_in(strings[dtype], strings[shape])
            for dtype, shape in {*zip(values["dtype"].tolist(), values["shape"].tolist())}
        }
        wanted = np.array(
            [expected[key] for key in zip(values["dtype"].tolist(), values["shape"].tolist())],
            dtype=np.float64,
        )
        if (np.isnan(wanted) | (wanted != counts[:, 0])).any():
            raise self.fail("an output whose element count does not match its shape")
        rest = stats[:, 3:]
        if not np.isfinite(rest).all():
            raise self.fail("an output whose statistics are not finite numbers")
        low, high, mean, norm, sketch = (
            rest[:, 0],
            rest[:, 1],
            rest[:, 2],
            rest[:, 3],
            rest[:, 4:],
        )
        largest = np.maximum(np.abs(low), np.abs(high))
        room = _SLACK * largest
        finite = counts[:, 0] - counts[:, 1] - counts[:, 2]
        empty = finite == 0
        if (empty & (rest != 0).any(axis=1)).any():
            raise self.fail("an output without finite values whose statistics are not zero")
        bound = sketch_bound(counts[:, 0]) * (1 + _SLACK)
        if (
            (low > high)
            | (mean < low - room)
            | (mean > high + room)
            | (norm < largest * (1 - _SLACK))
            | (norm > largest * np.sqrt(np.maximum(finite, 1)) * (1 + _SLACK))
            | (np.abs(sketch) > bound[:, None]).any(axis=1)
            | ((norm == 0) & (sketch != 0).any(axis=1))
        ).any():
            raise self.fail(
                "an output whose statistics no output can have (min above max, a mean "
                "outside them, a norm or sketch out of range)"
            )


def _numbers_in(dtype: str, shape: str) -> float:
    """How many real numbers an output of ``dtype`` and ``shape`` (``"[2, 3]"``) holds; NaN
    for a shape that is not a list of sizes."""
    try:
        sizes = json.loads(shape)
    except ValueError:
        return math.nan
    if not isinstance(sizes, list) or not all(
        isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in sizes
    ):
        return math.nan
    return float(math.prod(sizes) * (2 if dtype.startswith("complex") else 1))
