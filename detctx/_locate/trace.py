"""Op traces on disk: one compact record per op, streamed, read back as untrusted input.

A trace is ``MAGIC``, a version, then records. A string (op name, module
path, source line, output description) is written once, the first time it is
used, and referred to by number afterwards, so a record of an op is 46 bytes
whatever its tensors' sizes. The writer keeps at most :data:`BUFFER_BYTES`
of records in memory before writing them out; a run of a million ops holds
no more of its trace than a run of ten. The reader yields one record at a
time and checks everything: the header, every tag, every length and string
number, the text of every output description, and the end marker that
tells a complete trace from one cut short.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Generator
from pathlib import Path
from typing import Any, BinaryIO, Final, NamedTuple, Protocol

from detctx._basics import TraceError

__all__ = ["BUFFER_BYTES", "MAGIC", "OpRecord", "TraceWriter", "read_trace"]

MAGIC: Final = b"DETCTXTR"
VERSION: Final = 2
BUFFER_BYTES: Final = 1 << 16
"""Records kept in memory before they are written out."""
MAX_STRING: Final = 4096
MAX_STRINGS: Final = 1 << 20

_HEADER: Final = struct.Struct("<8sH")
_STRING: Final = struct.Struct("<IH")
_OP: Final = struct.Struct("<IIIIIQQQB")
_END: Final = struct.Struct("<Q")
_RANDOM: Final = 1
_WORD: Final = (1 << 64) - 1
_META: Final = re.compile(r"([A-Za-z0-9_.]{1,40})\|((?:\d{1,19}(?:,\d{1,19}){0,63})?)\|(.{1,64})")


class OpRecord(NamedTuple):
    """One recorded op: what ran, where, and the digest of what it produced.

    ``node`` is the autograd node (``AddmmBackward0``) for an op run by the
    backward pass, ``""`` in the forward pass. ``rng`` is a digest of the
    generator state before a random op (``None`` for other ops). ``dtype``,
    ``shape`` and ``device`` describe the op's first tensor output; ``digest``
    (128 bits) covers every output's bits, dtype and shape.
    """

    op: str
    module_path: str
    source: str
    node: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    digest: int
    rng: int | None

    def meta(self) -> str:
        return f"{self.dtype}|{','.join(map(str, self.shape))}|{self.device}"

    @classmethod
    def of(
        cls,
        op: str,
        where: tuple[str, str, str],
        meta: tuple[str, tuple[int, ...], str],
        high: int,
        low: int,
        rng: int,
        random: bool,
    ) -> OpRecord:
        """A record from its parts: the place (module path, source, node), the output
        description (dtype, shape, device), the digest's halves and the generator state."""
        return cls(op, *where, *meta, (high << 64) | low, rng if random else None)


class _Rows(Protocol):
    """A recorder's batch, as a trace sees it: ``rows`` of numbers (``tolist()`` gives
    ``(op, site, meta, random, rng, high, low)`` tuples) and ``record(i)``, row ``i``
    in strings."""

    rows: Any

    def record(self, position: int) -> OpRecord: ...


class TraceWriter:
    """Writes :class:`OpRecord` s to a binary file, :data:`BUFFER_BYTES` at a time."""

    def __init__(self, path: Path, *, exclusive: bool = False) -> None:
        self.path = path
        self._file: BinaryIO | None = open(path, "xb" if exclusive else "wb")
        self._pid = os.getpid()
        self._buffer = bytearray(_HEADER.pack(MAGIC, VERSION))
        self._strings: dict[str, int] = {}
        self._metas: dict[tuple[str, tuple[int, ...], str], int] = {}
        self._ids: dict[tuple[object, ...], tuple[int, int, int, int, int]] = {}
        self._numbered: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {}
        self.count = 0

    @property
    def buffered(self) -> int:
        """Bytes of records held in memory now (never more than :data:`BUFFER_BYTES`)."""
        return len(self._buffer)

    def _string(self, text: str) -> int:
        number = self._strings.get(text)
        if number is None:
            data = text.encode("utf-8", errors="replace")[:MAX_STRING]
            number = len(self._strings)
            self._strings[text] = number
            self._buffer += b"S" + _STRING.pack(number, len(data)) + data
        return number

    def _meta(self, record: OpRecord) -> int:
        key = (record.dtype, record.shape, record.device)
        number = self._metas.get(key)
        if number is None:
            number = self._metas[key] = self._string(record.meta())
        return number

    def _ids_of(self, record: OpRecord) -> tuple[int, int, int, int, int]:
        return (
            self._string(record.op),
            self._string(record.module_path),
            self._string(record.source),
            self._string(record.node),
            self._meta(record),
        )

    def add(self, record: OpRecord, outputs: object = None) -> None:
        """Append ``record`` (``outputs``, the tensors, are not written: digests only)."""
        if self._file is None:
            raise ValueError(f"the trace {self.path} is closed")
        key = record[:7]
        ids = self._ids.get(key)
        if ids is None:
            # One lookup per record once an op has been seen at this place and shape.
            ids = self._ids[key] = self._ids_of(record)
        random = record.rng is not None
        low, high = record.digest & _WORD, record.digest >> 64
        self._buffer += b"O" + _OP.pack(*ids, low, high, record.rng or 0, _RANDOM * random)
        self.count += 1
        if len(self._buffer) >= BUFFER_BYTES:
            self._flush()

    def add_batch(self, batch: _Rows) -> None:
        """Append a recorder's batch of rows (see :mod:`detctx._locate.batch`); an op's
        strings are looked up once per (op, place, output description) numbers."""
        if self._file is None:
            raise ValueError(f"the trace {self.path} is closed")
        numbered = self._numbered
        for position, (op, where, meta, random, rng, high, low) in enumerate(batch.rows.tolist()):
            ids = numbered.get((op, where, meta))
            if ids is None:
                record = batch.record(position)
                ids = numbered[(op, where, meta)] = self._ids_of(record)
            flags = _RANDOM if random else 0
            self._buffer += b"O" + _OP.pack(*ids, low, high, rng if random else 0, flags)
            self.count += 1
            if len(self._buffer) >= BUFFER_BYTES:
                self._flush()

    def _flush(self) -> None:
        if os.getpid() != self._pid:
            # A forked child holds a copy of the buffer: writing it would corrupt the trace.
            self._buffer.clear()
            return
        if self._file is not None and self._buffer:
            self._file.write(self._buffer)
            self._buffer.clear()

    def close(self) -> None:
        """Write the end marker and close the file (a second call does nothing)."""
        if self._file is None or os.getpid() != self._pid:
            return
        self._buffer += b"E" + _END.pack(self.count)
        self._flush()
        self._file.close()
        self._file = None


class _Reader:
    def __init__(self, path: Path, stream: BinaryIO) -> None:
        self.path = path
        self.stream = stream

    def fail(self, why: str) -> TraceError:
        return TraceError(f"op trace {self.path}: {why} at byte {self.stream.tell()}")

    def take(self, size: int, what: str) -> bytes:
        data = self.stream.read(size)
        if len(data) != size:
            raise self.fail(
                f"{what} is cut short: the run ended before its trace was closed (killed, "
                "or left through os._exit); run it again"
            )
        return data


def _parse_meta(reader: _Reader, text: str) -> tuple[str, tuple[int, ...], str]:
    match = _META.fullmatch(text)
    if match is None:
        raise reader.fail(f"output description {text[:80]!r} is malformed")
    dtype, shape, device = match.groups()
    return dtype, tuple(int(size) for size in shape.split(",")) if shape else (), device


def read_trace(path: Path) -> Generator[OpRecord, None, None]:
    """Yield the records of the trace at ``path``, one at a time.

    Raises :class:`~detctx.TraceError` for anything that is not a
    complete trace of this format, with the byte offset of the problem.
    """
    try:
        stream = open(path, "rb")
    except OSError as exc:
        raise TraceError(f"cannot read op trace {path}: {exc.strerror or exc}") from None
    with stream:
        reader = _Reader(path, stream)
        magic, version = _HEADER.unpack(reader.take(_HEADER.size, "the header"))
        if magic != MAGIC:
            raise reader.fail("not a detctx op trace (wrong magic bytes)")
        if version != VERSION:
            raise reader.fail(f"format version {version}, this detctx reads {VERSION}")
        strings: list[str] = []
        metas: dict[int, tuple[str, tuple[int, ...], str]] = {}
        count = 0
        while True:
            tag = reader.take(1, "a record tag")
            if tag == b"S":
                number, size = _STRING.unpack(reader.take(_STRING.size, "a string record"))
                if number != len(strings) or number >= MAX_STRINGS or size > MAX_STRING:
                    raise reader.fail(f"string record {number} of {size} bytes is out of order")
                try:
                    strings.append(reader.take(size, "a string").decode("utf-8"))
                except UnicodeDecodeError:
                    raise reader.fail("a string is not UTF-8") from None
            elif tag == b"O":
                *ids, low, high, rng, flags = _OP.unpack(reader.take(_OP.size, "an op record"))
                if max(ids) >= len(strings) or flags > _RANDOM:
                    raise reader.fail("an op record refers to an unknown string or flag")
                if ids[4] not in metas:
                    metas[ids[4]] = _parse_meta(reader, strings[ids[4]])
                names = tuple(strings[i] for i in ids[1:4])
                yield OpRecord.of(
                    strings[ids[0]], names, metas[ids[4]], high, low, rng, bool(flags & _RANDOM)
                )
                count += 1
            elif tag == b"E":
                (expected,) = _END.unpack(reader.take(_END.size, "the end marker"))
                if expected != count:
                    raise reader.fail(
                        f"the end marker counts {expected} ops, the trace has {count}"
                    )
                if stream.read(1):
                    raise reader.fail("data follows the end marker")
                return
            else:
                raise reader.fail(f"unknown record tag {tag!r}")
