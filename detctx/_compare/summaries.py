"""Each recorded op's trace row: its outputs' statistics and digest, written in op order.

An output's statistics and digest read all its bytes four times (the sketch, min and max,
the norm, the digest), more than a small training step's own time (docs/benchmarks.md). Each
large CPU output (at least :data:`SMALLEST_COPY` bytes) is copied as its op returns; where
the process has a CPU core to spare a helper thread computes the rows while the program runs
on, else the program does every :data:`BATCH_OPS` ops (or :data:`HANDOFF_BYTES` of copies).
The copy keeps this exact: nothing the program does afterwards (an in-place op, an optimizer
step, a collective writing into a gradient, NumPy or a C extension writing through the
memory, none of which the dispatcher need see) changes what is read, so each row holds the
output's values as its op returned, and a trace recorded with the helper is byte for byte
the one recorded without. The helper writes every row, in op order.

Outputs are summarised many at a time, each row and digest the one it has alone: small ones
(at most :data:`~detctx._compare.sketch.IN_NUMPY` numbers, most outputs by count) copied
into NumPy (:func:`~detctx._compare.sketch.small_rows`; bfloat16 as float32 values and its
bits), large float32 ones of one size stacked (:mod:`detctx._compare.stacked`), digests in a
:class:`~detctx._locate.Staging` buffer: some microseconds a small output, 50 a large one.

A core is spare when this process's CPU affinity holds more cores than torch's intra-op
threads take, for every local rank (``LOCAL_WORLD_SIZE``): ``ranks * (threads + 1) <=
cores``. Outputs on an accelerator, of other layouts, and larger than :data:`LARGEST_COPY`
are summarised in line. Copies waiting for the helper are bounded by :data:`PENDING_BYTES`,
the ops waiting by :data:`PENDING_OPS`; past either the program waits, so a helper that
falls behind slows the program and never grows its memory. Before a fork (a DataLoader
starting its workers) every op put so far is written, so the child inherits no thread in a
torch call and no rows to write. A summary that fails stops the program at its next op and
leaves the trace cut short, with a helper or without.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Final

import numpy as np
import torch

from detctx._compare.format import Inputs, TraceWriter, Unseen
from detctx._compare.sketch import (
    IN_NUMPY,
    SKETCH,
    STATISTICS,
    WIDENED,
    numpy_values,
    small_rows,
)
from detctx._compare.stacked import copy_summaries, staged_digests, statistics
from detctx._locate import PUBLIC_KEY, Staging, combine_digests, tensor_digest

__all__ = [
    "BATCH_OPS",
    "HANDOFF_BYTES",
    "LARGEST_COPY",
    "PENDING_BYTES",
    "PENDING_OPS",
    "SMALLEST_COPY",
    "Summaries",
    "spare_core",
]

PENDING_BYTES: Final = 256 << 20
"""Bytes of copies waiting for the helper before the program waits for it."""
PENDING_OPS: Final = 1 << 14
"""Ops waiting for the helper (queued, or in the batch it has in hand) before the program
waits for it. Bytes alone did not bound them: 2,000,000 ops of 16-byte outputs on a busy
machine held 2.3 to 2.7 GB (``python -m benchmarks.s13_record_memory``). The helper takes
half of this at a time, so the program fills the other half meanwhile."""
SMALLEST_COPY: Final = IN_NUMPY
"""Outputs too large for NumPy's rows are copied from this size (a float32 one of 40 KiB: some
480 us summarised alone in line, 100 copied and summarised with others)."""
LARGEST_COPY: Final = 64 << 20
"""Larger CPU outputs are summarised in line, not copied."""
BATCH_OPS: Final = 64
"""The small outputs of this many ops are summarised together; with a helper, it is woken
when this many ops wait (or :data:`HANDOFF_BYTES` of copies), before a fork and at the end."""
HANDOFF_BYTES: Final = 8 << 20
"""Bytes of copies waiting that wake the helper however few ops hold them."""
_UNREADABLE: Final = np.concatenate([np.zeros(3), np.full(len(STATISTICS) - 3 + SKETCH, np.nan)])


def spare_core() -> bool:
    """Whether every local rank can have a helper thread beside torch's intra-op threads."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    text = os.environ.get("LOCAL_WORLD_SIZE", "1")
    ranks = int(text) if text.isdigit() and 0 < len(text) < 6 else 0
    return 0 < ranks and ranks * (torch.get_num_threads() + 1) <= cores


class _Output:
    """One output: its description, its row and digest or what they are made from (a small
    one's numbers in NumPy, with a bfloat16 one's bits; a large one's copy)."""

    __slots__ = ("array", "copy", "digest", "dtype", "row", "shape", "size")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.copy: torch.Tensor | None = None
        self.array = numpy_values(tensor)
        self.row = _UNREADABLE
        self.digest = 0
        self.size = 0  # bytes of the copies this output holds
        if self.array is not None:
            self.size = self.array.nbytes
            if self.dtype in WIDENED:  # its row from float32 values, its digest from its bits
                self.copy = tensor.detach().clone(memory_format=torch.contiguous_format)
                self.size += self.copy.nbytes
        elif (
            (type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter)
            and tensor.is_cpu
            and tensor.layout == torch.strided
            and not tensor.is_quantized
            and SMALLEST_COPY <= tensor.nbytes <= LARGEST_COPY
        ):  # summarised with others' later (on the helper, or every BATCH_OPS ops)
            self.copy = tensor.detach().clone(memory_format=torch.contiguous_format)
            self.size = self.copy.nbytes
        else:
            self.compute(tensor)

    def compute(self, tensor: torch.Tensor) -> None:
        self.row = _row(tensor)
        self.digest = tensor_digest(tensor, key=PUBLIC_KEY) or 0


def _row(tensor: torch.Tensor) -> np.ndarray:
    row = statistics(tensor)
    return _UNREADABLE if row is None else row


_Strings = tuple[str, str, str, str, str]
"""An op's name, module path, source line, autograd node and scalar arguments."""
_Op = tuple[_Strings, list[_Output], Inputs, int, Unseen]


class Summaries:
    """Turns recorded ops into ``writer``'s rows: in line, or on a helper thread."""

    def __init__(self, writer: TraceWriter, *, helper: Callable[[], bool]) -> None:
        self.writer = writer
        # Asked at the first op, not here: `detctx record` starts recording before the
        # program has set torch's thread count.
        self._decide: Callable[[], bool] | None = helper
        self._described: dict[tuple[torch.dtype, tuple[int, ...]], tuple[int, int]] = {}
        self._queue: collections.deque[_Op] = collections.deque()
        self._changed = threading.Condition()
        self._pending = 0
        self._in_hand = 0  # ops in the batch the helper has in hand
        self._busy = False
        self._closing = False
        self._draining = False
        self._stalled = False  # the program waits for room
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._batch: list[_Op] = []
        self._batch_bytes = 0  # of the copies the batch holds (without a helper)
        self._staging: Staging | None = None

    def put(
        self, strings: _Strings, outputs: list[torch.Tensor], inputs: Inputs, unseen: Unseen = ()
    ) -> None:
        """One recorded op: its strings, outputs, producers, and its unseen inputs' digests."""
        if self._decide is not None:
            decide, self._decide = self._decide, None
            if decide():
                self._thread = threading.Thread(
                    target=self._serve, name="detctx-summaries", daemon=True
                )
                self._thread.start()
        self._raise_failure()
        self.writer.begin()  # the header describes the program as the first op ran
        helper = self._thread is not None
        if not helper:
            with self._failing():
                summaries = self._outputs(outputs)
                self._batch.append((strings, summaries, inputs, 0, unseen))
                self._batch_bytes += sum(output.size for output in summaries)
                if len(self._batch) >= BATCH_OPS or self._batch_bytes >= HANDOFF_BYTES:
                    batch, self._batch, self._batch_bytes = self._batch, [], 0
                    self._finish(batch)
            return
        try:
            summaries = self._outputs(outputs)
        except Exception as exc:
            raise self._fail_beside_helper(exc)  # noqa: B904 (its cause is the failure)
        size = sum(output.size for output in summaries)
        op = (strings, summaries, inputs, size, unseen)
        with self._changed:
            while not self._failure and (
                len(self._queue) + self._in_hand >= PENDING_OPS
                or (self._pending and self._pending + size > PENDING_BYTES)
            ):
                self._stalled = True  # the helper takes what waits, however little
                self._changed.notify_all()
                self._changed.wait()
            self._stalled = False
            self._queue.append(op)
            self._pending += size
            # The helper is woken for a batch, not for each op: every wake costs both
            # threads a switch of the GIL.
            if len(self._queue) >= BATCH_OPS or self._pending >= HANDOFF_BYTES:
                self._changed.notify_all()

    def drain(self) -> None:
        """Wait until every op put so far is written (the recorder does, before a fork)."""
        if self._thread is None:
            self._flush()
            return
        with self._changed:
            self._draining = True
            self._changed.notify_all()
            try:
                while (self._queue or self._busy) and self._failure is None:
                    self._changed.wait()
            finally:
                self._draining = False

    def close(self) -> None:
        """Write every op put so far and stop the helper; raises what the helper raised."""
        thread, self._thread = self._thread, None
        if thread is None:
            self._flush()
            self._raise_failure()
            return
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        try:
            thread.join()
        except BaseException:
            # Interrupted while the helper writes the queue's rows (a second Ctrl-C): drop
            # the rest, wait for the ops in hand, and leave the trace cut short, not short.
            with self._changed:
                self._queue.clear()
                self._pending = 0
            thread.join()
            self.writer.cut()
            raise
        self._raise_failure()

    def abandon(self) -> None:
        """Forget the queue and the helper (a forked child, where the thread does not exist)."""
        self._thread = None
        self._queue.clear()
        self._batch.clear()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failed(self._failure)

    @staticmethod
    def _failed(failure: BaseException) -> RuntimeError:
        error = RuntimeError(
            "detctx: summarising a recorded op failed; the trace is left cut short"
        )
        error.__cause__ = failure
        return error

    def _flush(self) -> None:
        """Without a helper: write the ops put since the last flush."""
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if batch:
            with self._failing():
                self._finish(batch)

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """Without a helper: a summary that fails (or an interrupt while rows are made)
        leaves the trace cut short, and the failure is raised as the helper's would be."""
        try:
            yield
        except BaseException as exc:
            self._batch.clear()
            self.writer.cut()  # rows from here on are missing: not a complete trace
            if not isinstance(exc, Exception):
                raise
            self._failure = exc
            self._raise_failure()

    def _fail_beside_helper(self, exc: Exception) -> RuntimeError:
        """A summary failed in the program's thread: the helper writes the ops in hand, the
        rest are dropped, the trace is left cut short (as when the helper fails); the error."""
        with self._changed:
            self._queue.clear()
            self._pending = 0
            while self._busy:
                self._changed.wait()
            failure = self._failure = self._failure or exc
        self.writer.cut()
        return self._failed(failure)

    def _staging_buffer(self) -> Staging:
        if self._staging is None:
            self._staging = Staging(key=PUBLIC_KEY)
        return self._staging

    @staticmethod
    def _outputs(outputs: list[torch.Tensor]) -> list[_Output]:
        return [_Output(tensor) for tensor in outputs]

    def _ready(self) -> bool:
        """Whether the helper takes what waits now: a batch, or what the program waits for."""
        return bool(self._queue) and (
            self._closing
            or self._draining
            or self._stalled
            or len(self._queue) >= BATCH_OPS
            or self._pending >= HANDOFF_BYTES
        )

    def _serve(self) -> None:
        with torch.no_grad():
            while True:
                with self._changed:
                    while not self._ready() and not (self._closing and not self._queue):
                        self._changed.wait()
                    if not self._queue:
                        return  # closing, and every op written
                    # The ops waiting: their small outputs are summarised together.
                    take = min(len(self._queue), PENDING_OPS // 2)
                    batch = [self._queue.popleft() for _ in range(take)]
                    self._in_hand = take
                    self._busy = True
                try:
                    self._finish(batch)
                except BaseException as exc:  # raised in the program's thread, at its next op
                    self.writer.cut()  # rows from here on are missing: not a complete trace
                    with self._changed:
                        self._failure = exc
                        self._queue.clear()
                        self._pending = 0
                        self._in_hand = 0
                        self._busy = False
                        self._changed.notify_all()
                    return
                with self._changed:
                    self._pending -= sum(op[3] for op in batch)
                    self._in_hand = 0
                    self._busy = False
                    self._changed.notify_all()

    def _finish(self, batch: list[_Op]) -> None:
        """Compute the rows and digests of ``batch``'s outputs and write its ops, in order."""
        small = [output for op in batch for output in op[1] if output.array is not None]
        arrays = [output.array for output in small if output.array is not None]
        if arrays:
            rows = small_rows(arrays)
            bits = [a if out.copy is None else out.copy for out, a in zip(small, arrays)]
            digests = staged_digests(self._staging_buffer(), bits)
            for output, row, digest in zip(small, rows, digests):
                output.row, output.digest, output.array, output.copy = row, digest, None, None
        # Large outputs' copies: float32 ones of one size measured together (their digests
        # from that stack), other digests in a staging buffer; each row and digest its own.
        copied = [output for op in batch for output in op[1] if output.copy is not None]
        copies = [output.copy for output in copied if output.copy is not None]
        if copies:
            measured, digests = copy_summaries(self._staging_buffer(), copies)
            for output, copy, row, digest in zip(copied, copies, measured, digests):
                output.copy, output.digest = None, digest
                output.row = row if row is not None else _row(copy)
        for strings, outputs, inputs, _, unseen in batch:
            self._write(strings, outputs, inputs, unseen)

    def _write(
        self, strings: _Strings, outputs: list[_Output], inputs: Inputs, unseen: Unseen
    ) -> None:
        writer = self.writer
        values: list[tuple[int, int, int, np.ndarray]] = []
        for output in outputs:
            key = (output.dtype, output.shape)
            described = self._described.get(key)
            if described is None:
                described = self._described[key] = (
                    writer.string(str(output.dtype).removeprefix("torch.")),
                    writer.string(str(list(output.shape))),
                )
            values.append((*described, output.digest, output.row))
        op, module, source, node, scalars = strings
        numbers = (
            writer.string(op),
            writer.string(module),
            writer.string(source),
            writer.string(node),
            writer.string(scalars),
        )
        digest = combine_digests([output.digest for output in outputs])
        writer.add(numbers, digest, values, inputs, unseen)
