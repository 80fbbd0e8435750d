"""Exact products of int8 bytes and int8 weights, as the digest's reduce step takes them.

``torch._int_mm`` makes them with int8 dot-product instructions where the CPU
has them (VNNI: some 16 GB/s on one core); on a CPU without them (AVX2 only)
torch runs it at some 0.17 GB/s. :func:`int_matmul` then makes the same int32
sums by float32 products of :data:`_CHUNK` bytes at a time, each exact, at
some 1.5 GB/s, 1.8 where the bytes are detctx's own (NumPy converts them, faster than
torch): which of the two a process takes is timed once, on a probe.
"""

from __future__ import annotations

import math
import time
from typing import Final

import numpy as np
import torch

from detctx._locate.keys import COLUMNS, ROW_BYTES

__all__ = ["int_matmul"]

_CHUNK: Final = 1024
"""Bytes of a row one float32 product sums: ``1024 * 128 * 127 < 2**24``, so every partial
sum of int8 products is an integer float32 holds exactly, in whatever order it adds."""
_BLOCK_ROWS: Final = 16
"""Rows converted to float32 at a time (512 KiB of floats): they stay in a core's cache."""
_chunked: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # id -> the matrix (kept), its floats
_method: list[bool] = []  # [whether the float32 products beat torch._int_mm], once measured


def _float_weights(weights: torch.Tensor) -> np.ndarray:
    """``weights`` as float32, cut into ``_CHUNK``-row blocks (made once per matrix)."""
    known = _chunked.get(id(weights))
    if known is not None and known[0] is weights:
        return known[1]
    rows, columns = weights.shape
    found = weights.to(torch.float32).numpy().reshape(rows // _CHUNK, _CHUNK, columns)
    if len(_chunked) >= 16:  # a key's matrices live as long as the key; keys are few
        _chunked.clear()
    _chunked[id(weights)] = (weights, found)
    return found


def _float_product(rows: torch.Tensor, weights: torch.Tensor, own: bool = False) -> torch.Tensor:
    """``rows @ weights`` of int8 CPU operands through float32 products of ``_CHUNK`` bytes,
    each exact, summed in int32: the same sums as ``torch._int_mm``. Where the CPU has no
    int8 dot-product instructions (no VNNI) torch's int8 product reads some 0.17 GB/s,
    this some 1.5 (``own``: 1.8) GB/s on one core (2-core AMD EPYC). ``own``: ``rows`` is
    detctx's own memory, which NumPy may read (never the program's: torch makes a CPU
    tensor's memory NumPy has seen non-resizable for good), and converts faster than
    torch."""
    chunked = _float_weights(weights)
    chunks, columns = chunked.shape[0], chunked.shape[2]
    count = rows.shape[0]
    total = np.empty((count, columns), dtype=np.int32)
    if not count:
        return torch.from_numpy(total)
    # Each block is converted into one float32 buffer (no allocation a block) that NumPy
    # multiplies: its BLAS is the faster on these narrow products.
    block_rows = min(_BLOCK_ROWS, count)
    floats = torch.empty((block_rows, chunks * _CHUNK), dtype=torch.float32)
    buffer = floats.numpy()
    data = rows.numpy() if own and rows.is_contiguous() else None
    products = np.empty((chunks, block_rows, columns), dtype=np.float32)
    for start in range(0, count, block_rows):
        held = min(block_rows, count - start)
        if data is None:
            converted = floats[:held].copy_(rows[start : start + held]).numpy()
        else:
            converted = buffer[:held]
            np.copyto(converted, data[start : start + held], casting="unsafe")
        made = products[:, :held]
        np.matmul(converted.reshape(held, chunks, _CHUNK).transpose(1, 0, 2), chunked, out=made)
        # Each chunk's sums are exact integers below 2**24; their sum is made in int32.
        total[start : start + held] = made.astype(np.int32).sum(axis=0)
    return torch.from_numpy(total)


def _floats_are_faster() -> bool:
    """Whether :func:`_float_product` beats ``torch._int_mm`` on this CPU, timed once on
    32 rows (both give the same sums, so the choice changes only the time taken)."""
    if not _method:
        probe = torch.zeros(32, ROW_BYTES, dtype=torch.int8)
        weights = torch.ones(ROW_BYTES, COLUMNS, dtype=torch.int8)
        timings = []
        for floats in (True, False):
            best = math.inf
            for _ in range(3):
                started = time.perf_counter()
                try:
                    _float_product(probe, weights) if floats else torch._int_mm(probe, weights)
                except (AttributeError, RuntimeError):
                    if floats:
                        raise
                    break  # torch before 2.2 has no int8 product on the CPU
                best = min(best, time.perf_counter() - started)
            timings.append(best)
        _method.append(timings[0] <= timings[1])
    return _method[0]


def int_matmul(rows: torch.Tensor, weights: torch.Tensor, *, own: bool = False) -> torch.Tensor:
    """``rows @ weights`` for int8 operands, exact, as int32. ``own``: ``rows`` is detctx's
    own memory (a copy, a staging buffer), not the program's."""
    try:
        if (
            rows.is_cpu
            and weights.is_cpu
            and weights.shape[0] % _CHUNK == 0
            and _floats_are_faster()
        ):
            return _float_product(rows, weights, own)
        return torch._int_mm(rows, weights)
    except (AttributeError, RuntimeError):
        # torch before 2.2 on the CPU, or a device without int8 products (CUDA takes
        # more than 16 rows only). Sums stay below 8192 * 128 * 128 = 2**27: exact in
        # float64 on every device.
        return (rows.to(torch.float64) @ weights.to(torch.float64)).to(torch.int32)
