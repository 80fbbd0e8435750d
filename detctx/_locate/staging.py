"""Many small CPU tensors digested together, to the same digests as one at a time.

A recorder digests thousands of small tensors a second; one at a time,
NumPy's per-call cost, not the bytes, is what counts. :class:`Staging`
copies each tensor's bytes into a buffer as its op runs and digests every
tensor in it with one matrix product and a few vectorised sums when it is
asked to (see :mod:`detctx._locate.digest` for the digest itself).
"""

from __future__ import annotations

import os
import threading
from typing import Final

import numpy as np
import torch

from detctx._locate.digest import (
    COLUMNS,
    NUMPY_DTYPES,
    ROW_BYTES,
    SMALL,
    STAGED,
    STREAM_A,
    STREAM_C,
    host_copy,
    int_matmul,
    layout_halves,
    tensor_bytes,
)
from detctx._locate.keys import DigestKey, process_key

__all__ = ["CAPACITY", "Staging", "borrow", "give_back", "host_bytes", "stacked_digests"]

CAPACITY: Final = 1 << 22
"""Bytes of rows a recorder's buffer holds (plus an eighth of that for small tensors)."""


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements in logical order as a 1-D uint8 array of a copy (never a NumPy
    view of the tensor's memory, which torch makes non-resizable: see :func:`host_copy`)."""
    if tensor.dtype in NUMPY_DTYPES:
        flat: np.ndarray = host_copy(tensor).reshape(-1).view(np.uint8)
        return flat
    return tensor_bytes(tensor).clone().numpy()


def _segment_sums(
    words: np.ndarray, starts: np.ndarray, lengths: np.ndarray, key: DigestKey
) -> tuple[np.ndarray, np.ndarray]:
    """``(S_A, S_B)`` of each segment of ``words`` (uint64), every segment's streams from 0."""
    first = np.zeros(len(starts), dtype=np.uint64)
    second = np.zeros(len(starts), dtype=np.uint64)
    if not len(words):
        return first, second
    used = lengths > 0
    offsets = np.arange(len(words)) - np.repeat(starts, lengths)
    kept = starts[used]
    # uint64 products and sums wrap modulo 2**64, as in _host_sums.
    first[used] = np.add.reduceat(words * key.stream(STREAM_A)[offsets], kept)
    second[used] = np.add.reduceat(words.byteswap() * key.stream(STREAM_C)[offsets], kept)
    return first, second


def _row_sums(
    data: torch.Tensor, begins: np.ndarray, rows: np.ndarray, key: DigestKey
) -> tuple[np.ndarray, np.ndarray]:
    """``(S_A, S_B)`` of tensors laid in ``data`` (detctx's own uint8 bytes, whole rows of
    :data:`ROW_BYTES`), each from row ``begins[i]`` for ``rows[i]`` rows: one reduce step's
    product for all of them, then each tensor's sums of its part of it."""
    weights = key.weights(0, data.device)
    product = int_matmul(data.view(torch.int8).view(-1, ROW_BYTES), weights, own=True)
    # One row of the product (COLUMNS int32 sums) is four words.
    words = product.numpy().reshape(-1).view(np.uint64)
    per_row = 4 * COLUMNS // 8
    return _segment_sums(words, begins * per_row, rows * per_row, key)


def stacked_digests(
    stack: torch.Tensor, shapes: list[tuple[int, ...]], key: DigestKey
) -> list[int]:
    """The digests of the ``k`` tensors of ``shapes`` laid in the rows of ``stack`` (``k x n``,
    contiguous, detctx's own memory: read in place, not copied into a buffer), each the one
    :func:`digest` gives it alone; each row's bytes must be whole rows of :data:`ROW_BYTES`,
    more than :data:`SMALL` and at most :data:`STAGED` of them (one reduce step)."""
    k = stack.shape[0] if stack.dim() == 2 else 0
    size = stack.shape[1] * stack.element_size() if stack.dim() == 2 else 0
    if (
        stack.dim() != 2
        or not stack.is_contiguous()
        or stack.dtype not in NUMPY_DTYPES
        or size % ROW_BYTES
        or not SMALL < size <= STAGED
        or len(shapes) != k
    ):
        raise ValueError("stacked_digests takes whole rows of one reduce step")
    rows = size // ROW_BYTES
    begins = np.arange(k, dtype=np.int64) * rows
    first, second = _row_sums(
        stack.reshape(-1).view(torch.uint8), begins, np.full(k, rows, np.int64), key
    )
    halves = [layout_halves(stack.dtype, shape) for shape in shapes]
    first ^= np.array([high for high, _ in halves], dtype=np.uint64)
    second ^= np.array([low for _, low in halves], dtype=np.uint64)
    return [(int(high) << 64) | int(low) for high, low in zip(first, second)]


class Staging:
    """Many small CPU tensors' digests, computed together.

    :meth:`add` copies a tensor's bytes in (at most :data:`STAGED` of them):
    one of at most :data:`SMALL` bytes into a buffer of words, a larger one
    into a buffer of :data:`ROW_BYTES` rows, padded to whole rows.
    :meth:`digests` then reduces every row with one matrix product and sums
    every tensor with a few vectorised calls; each digest equals
    :func:`digest` of that tensor under ``key`` (default: this process's
    key, taken when the buffer is made). Nothing is kept of the tensors
    themselves: their bytes are copied when they are added, so a tensor
    written to afterwards does not change its digest.
    """

    def __init__(self, capacity: int = CAPACITY, *, key: DigestKey | None = None) -> None:
        if capacity % ROW_BYTES or capacity < STAGED:
            raise ValueError(f"capacity must be a multiple of {ROW_BYTES} and at least {STAGED}")
        self.capacity = capacity
        self.key = process_key() if key is None else key
        self._rows = np.zeros(capacity, dtype=np.uint8)
        self._words = np.zeros(capacity // 8, dtype=np.uint8)
        self._rows_used = 0
        self._words_used = 0
        # Per tensor: whether it went to the rows, where it starts, its size in bytes,
        # its dtype and shape (to give it back), and its layout code.
        self._in_rows: list[bool] = []
        self._starts: list[int] = []
        self._sizes: list[int] = []
        self._layouts: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self._high: list[int] = []
        self._low: list[int] = []

    def __len__(self) -> int:
        return len(self._starts)

    def room_for(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` (each of at most :data:`STAGED` bytes) all fit now."""
        words, rows = self._words_used, self._rows_used
        for tensor in tensors:
            size = tensor.nbytes
            if size <= SMALL:
                words += -(-size // 8) * 8
            else:
                rows += -(-size // ROW_BYTES) * ROW_BYTES
        return words <= len(self._words) and rows <= self.capacity

    def add(self, tensor: torch.Tensor, *, owned: bool = False) -> int:
        """Copy ``tensor``'s bytes in (check :meth:`room` first); its number. ``owned``: the
        tensor is the caller's own copy, which NumPy may read in place (never the
        program's tensor: see :func:`host_bytes`)."""
        if (
            owned
            and tensor.dtype in NUMPY_DTYPES
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
        ):
            data = tensor.numpy().reshape(-1).view(np.uint8)
        else:
            data = host_bytes(tensor)
        size = data.size
        if size <= SMALL:
            buffer, start = self._words, self._words_used
            end = start + (size + 7) // 8 * 8
            self._words_used = end
        else:
            buffer, start = self._rows, self._rows_used
            end = start + (size + ROW_BYTES - 1) // ROW_BYTES * ROW_BYTES
            self._rows_used = end
        buffer[start : start + size] = data
        if end > start + size:
            buffer[start + size : end] = 0
        self._in_rows.append(size > SMALL)
        self._starts.append(start)
        self._sizes.append(size)
        dtype, shape = tensor.dtype, tensor.shape
        self._layouts.append((dtype, shape))
        high, low = layout_halves(dtype, shape)
        self._high.append(high)
        self._low.append(low)
        return len(self._starts) - 1

    def tensor(self, number: int) -> torch.Tensor:
        """A copy of tensor ``number`` as it was added."""
        start, size = self._starts[number], self._sizes[number]
        buffer = self._rows if self._in_rows[number] else self._words
        dtype, shape = self._layouts[number]
        if not size:
            return torch.empty(shape, dtype=dtype)
        data = torch.from_numpy(buffer[start : start + size].copy())
        return data.view(dtype).reshape(shape)

    def digests(self) -> tuple[np.ndarray, np.ndarray]:
        """The digest of every tensor added, in order, as its high and low 64 bits
        (uint64 arrays; see :func:`digest`)."""
        count = len(self._starts)
        in_rows = np.array(self._in_rows, dtype=bool)
        starts = np.array(self._starts, dtype=np.int64)
        sizes = np.array(self._sizes, dtype=np.int64)
        first = np.zeros(count, dtype=np.uint64)
        second = np.zeros(count, dtype=np.uint64)
        direct = ~in_rows
        if direct.any():
            # Each tensor's words lie back to back in order, so a tensor's length runs
            # to the next one's start.
            words = self._words[: self._words_used].view(np.uint64)
            begin = starts[direct] // 8
            length = np.diff(begin, append=len(words))
            first[direct], second[direct] = _segment_sums(words, begin, length, self.key)
        if in_rows.any():
            matrix = torch.from_numpy(self._rows[: self._rows_used])
            first[in_rows], second[in_rows] = _row_sums(
                matrix, starts[in_rows] // ROW_BYTES, -(-sizes[in_rows] // ROW_BYTES), self.key
            )
        first ^= np.array(self._high, dtype=np.uint64)
        second ^= np.array(self._low, dtype=np.uint64)
        return first, second

    def clear(self) -> None:
        """Forget every tensor added (the buffers are kept for the next ones)."""
        self._rows_used = self._words_used = 0
        self._in_rows.clear()
        self._starts.clear()
        self._sizes.clear()
        self._layouts.clear()
        self._high.clear()
        self._low.clear()


_pool: list[Staging] = []
_pool_lock = threading.Lock()


def _fresh_pool_in_child() -> None:
    # A child forked while another thread held the lock would wait for that thread.
    global _pool_lock
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_fresh_pool_in_child)


def borrow() -> Staging:
    """An empty buffer of :data:`CAPACITY` bytes, one used before if there is one.

    Memory touched for the first time costs a page fault per 4 KiB, which in a
    virtual machine can cost more than the bytes' digest: one recording after
    another reuses the same pages.
    """
    key = process_key()
    with _pool_lock:
        while _pool:
            staging = _pool.pop()
            if staging.key is key:
                return staging
    # None kept, or kept under a key this process no longer digests with (its digests
    # would not compare with those of ops digested at once).
    return Staging(key=key)


def give_back(staging: Staging) -> None:
    """Return a buffer from :func:`borrow` (emptied; at most two are kept)."""
    staging.clear()
    if staging.capacity != CAPACITY:
        return
    with _pool_lock:
        if len(_pool) < 2:
            _pool.append(staging)
