"""Traces read back as untrusted input: every byte checked before anything is compared.

:func:`read_trace` checks lengths, CRCs (the header's and every chunk's),
every string and row number, every producer being an earlier op, and every
output's statistics being ones an output of its shape can have, and raises
:class:`~detctx.TraceError` naming the file and byte offset. Reading one
holds about twice its size in memory, nothing more.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
import zlib
from pathlib import Path
from typing import Any, Final

import numpy as np

from detctx._basics import TraceError
from detctx._compare.format import (
    CHUNK,
    FORMAT,
    INPUT,
    MAGIC,
    MAX_OUTCOME,
    MAX_STRING,
    OP,
    PREFIX,
    SKETCH_SHAPE,
    START,
    VALUE,
    VERSION,
    Trace,
)
from detctx._compare.sketch import sketch_bound

__all__ = ["MAX_BYTES", "is_trace", "read_run", "read_trace"]

MAX_BYTES: Final = 1 << 34
"""The largest trace read (16 GiB; it is held in memory while compared)."""
_MAX_HEADER: Final = 1 << 20
_RANK_FILE: Final = re.compile(r"rank(0|[1-9][0-9]{0,5})\.trace")
_SLACK: Final = 1e-5
"""Relative room for rounding in the checks between an output's statistics."""


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
        if len(self.data) < START.size or self.data[: len(MAGIC)] != MAGIC:
            raise TraceError(f"{self.path} is not a detctx statistics trace (no header)")
        version = struct.unpack_from("<I", self.data, len(MAGIC))[0]
        if version != VERSION:
            raise TraceError(
                f"trace {self.path} is in format version {version}, this detctx reads "
                f"{VERSION}: record it again with this detctx"
            )
        _, _, size, crc = START.unpack(self.take(START.size, "the header"))
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
            kind, length, crc = CHUNK.unpack(self.take(CHUNK.size, "a chunk header"))
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
                if not isinstance(outcome, str) or not 0 < len(outcome) <= MAX_OUTCOME:
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
        if header.get("sketch") != SKETCH_SHAPE:
            raise self.fail(
                f"a sketch of shape and key {header.get('sketch')!r}, not {SKETCH_SHAPE}"
            )
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
        if len(payload) < PREFIX.size:
            raise self.fail("a chunk too short for its prefix")
        (size,) = PREFIX.unpack_from(payload)
        if size > len(payload) - PREFIX.size:
            raise self.fail("a chunk prefix longer than its chunk")
        prefix = self.json_of(payload[PREFIX.size : PREFIX.size + size], "chunk prefix")
        new, counts = (
            (prefix.get("strings"), prefix.get("rows"))
            if isinstance(prefix, dict)
            else (None, None)
        )
        if not isinstance(new, list) or not all(
            isinstance(text, str) and len(text) <= MAX_STRING for text in new
        ):
            raise self.fail("a chunk whose strings are not a list of short strings")
        if not (
            isinstance(counts, list)
            and len(counts) == 3
            and all(isinstance(c, int) and c >= 0 for c in counts)
        ):
            raise self.fail("a chunk whose row counts are not three non-negative integers")
        sizes = [count * dtype.itemsize for count, dtype in zip(counts, (OP, VALUE, INPUT))]
        if PREFIX.size + size + sum(sizes) != len(payload):
            raise self.fail("a chunk whose length does not match its row counts")
        strings.extend(new)
        offset = PREFIX.size + size
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
        for name in ("op", "module", "source", "node", "scalars"):
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
            if ((inputs["high"][made] != 0) | (inputs["low"][made] != 0)).any():
                raise self.fail("an input made by a recorded op with a digest of its own")

    def check_statistics(self, values: np.ndarray, strings: list[str]) -> None:
        """Every output's statistics are ones an output of its shape can have: counts that are
        counts and match the shape (its zeros: some of its finite values, all of them exactly
        where its min and max are 0), finite min <= max with the mean between them, a norm
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
        pairs = values["dtype"].astype(np.uint64) << np.uint64(32) | values["shape"].astype(
            np.uint64
        )
        kinds, which = np.unique(pairs, return_inverse=True)
        expected = np.array(
            [_numbers_in(strings[k >> 32], strings[k & 0xFFFFFFFF]) for k in kinds.tolist()],
            dtype=np.float64,
        )
        wanted = expected[which.reshape(-1)]
        if (np.isnan(wanted) | (wanted != counts[:, 0])).any():
            raise self.fail("an output whose element count does not match its shape")
        rest = stats[:, 3:]
        if not np.isfinite(rest).all():
            raise self.fail("an output whose statistics are not finite numbers")
        low, high, mean, norm, zeros, sketch = (
            rest[:, 0],
            rest[:, 1],
            rest[:, 2],
            rest[:, 3],
            rest[:, 4],
            rest[:, 5:],
        )
        largest = np.maximum(np.abs(low), np.abs(high))
        room = _SLACK * largest
        finite = counts[:, 0] - counts[:, 1] - counts[:, 2]
        if (
            (zeros < 0)
            | (zeros != np.floor(zeros))
            | (zeros > finite)
            | ((zeros == finite) != (largest == 0))
        ).any():
            raise self.fail(
                "an output whose count of zeros is not a count of its finite values, or "
                "disagrees with its min and max"
            )
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


def read_run(path: str | os.PathLike[str]) -> dict[int, Trace]:
    """A run's traces by rank: one file, or a folder of ``rank<N>.trace`` files."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path} does not exist: give a trace file or a folder of rank traces")
    if not path.is_dir():
        trace = read_trace(path)
        return {int(trace.header["rank"]): trace}
    traces: dict[int, Trace] = {}
    for child in sorted(path.iterdir()):
        match = _RANK_FILE.fullmatch(child.name)
        if match is None:
            continue
        trace = read_trace(child)
        if trace.header["rank"] != int(match.group(1)):
            raise TraceError(f"trace {child} holds rank {trace.header['rank']}'s ops")
        traces[int(match.group(1))] = trace
    if not traces:
        raise TraceError(f"{path} holds no rank<N>.trace files")
    _check_one_run(path, traces)
    return traces


def _check_one_run(path: Path, traces: dict[int, Trace]) -> None:
    """A folder's traces are the ranks of one recorded run, all of them."""
    runs = {trace.header["run"] for trace in traces.values()}
    if len(runs) > 1:
        by_run = {
            run: sorted(r for r, trace in traces.items() if trace.header["run"] == run)
            for run in sorted(runs)
        }
        described = "; ".join(f"ranks {ranks} of run {run}" for run, ranks in by_run.items())
        raise TraceError(
            f"{path} mixes the traces of several recorded runs ({described}): compare the "
            "ranks of one run with another's; record again into an empty folder"
        )
    worlds = {trace.header["world_size"] for trace in traces.values()}
    if len(worlds) > 1:
        raise TraceError(f"{path} holds traces of world sizes {sorted(worlds)}: not one run")
    (world,) = worlds
    missing = sorted(set(range(world)) - set(traces))
    if missing or len(traces) != world:
        raise TraceError(
            f"{path} holds the traces of ranks {sorted(traces)} of a run of {world} ranks: "
            f"rank{missing[0] if missing else ''}.trace is missing; a run is compared with "
            "all its ranks (give one rank's file to compare that rank alone)"
        )
