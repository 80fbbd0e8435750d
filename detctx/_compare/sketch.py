"""Per-output statistics and a sketch from which two runs' relative error is estimated.

Every recorded output gets a fixed-size row of float64 numbers
(:data:`STATISTICS` names them): its element count, NaN and Inf counts,
min, max, mean, L2 norm, and a sketch of :data:`SKETCH` numbers.

**The sketch.** The output, read in logical order as ``n`` numbers (padded
with zeros to a multiple of :data:`COLUMNS`), is laid out as a matrix ``X``
of ``n / COLUMNS`` rows and :data:`COLUMNS` columns, and multiplied by a
fixed matrix ``S`` of :data:`SIGNS` rows of random signs (+1 or -1, one per
row of ``X`` and sign row, from a position hash, so every machine, torch and
NumPy release draws the same): the sketch is ``S @ X``, ``SIGNS x COLUMNS``
numbers. It is linear, so the sketch of A's output minus the sketch of B's
is the sketch of the difference ``d = a - b``, and

    ||d||^2  ~  (1 / SIGNS) * sum((sketch_A - sketch_B)^2)

is an unbiased estimate for any ``d``: each number is ``sum_r s_r d[r, j]``,
whose square has expectation ``sum_r d[r, j]^2`` for independent signs.

**How accurate.** The squared estimate's relative standard deviation is
``sqrt(2 / SIGNS) = 0.71`` in the worst case (a difference that is the same
in every column, so the columns are one sample), and about
``sqrt(2 / (SIGNS * COLUMNS)) = 0.18`` for a difference spread over many
elements without such structure (rounding noise, a scaled tensor, a changed
kernel); the norm, a square root, is within about 9% then, and within a
factor of 3 in all but about 2 cases in 100 even in the worst case (the
chance that a chi-square of 4 degrees falls below 4/9; the tests check
both on drawn differences). That is enough for what it decides: whether an
error is above or below a tolerance that sits orders of magnitude from both
kernel noise and a real change (see :data:`detctx._compare.compare.TOLERANCES`).
Float32 outputs of more than :data:`IN_NUMPY` numbers are sketched in
float32 (BLAS sums): the sketch's own rounding, about ``2**-24`` of the
column norms, is below every float32 tolerance; smaller outputs (most ops'
outputs by count) are summarised in float64 NumPy, many at a time
(:func:`small_rows`), each sum running over one output's numbers in order. Which of the two an
output takes depends only on its device, dtype and size, so equal bits give
equal sketches on one machine; the tolerance comparison never rests on
differences that small. Bitwise equality is decided by the digest, not by
the sketch.

**NaN and Inf.** An output holding them (an attention mask of ``-inf``) is
counted (NaN, Inf), and its mean, norm and sketch are those of its finite
values, the others taken as zeros: a difference among its finite values
shows as in any other output, one in where the NaN and Inf lie does not
(only their counts are compared). Min and max are over all its values.

**What it cannot see.** A difference confined to a few elements whose
signs happen to cancel in every row of ``S`` (probability ``2**-SIGNS`` for
one element; none for a single element, whose change always shows), and
anything about *where* in the tensor the difference lies.

Cost: one small matrix product (0.6 to 1.2 ms for 2 million float32 numbers
on one CPU core, two to four times an elementwise multiply), ``aminmax`` and
a norm: three reads of the output; some ten microseconds for a small output
summarised with others.
"""

from __future__ import annotations

import functools
from typing import Final

import numpy as np
import torch

from detctx._locate import NUMPY_DTYPES

__all__ = [
    "COLUMNS",
    "SIGNS",
    "SKETCH",
    "STATISTICS",
    "estimate_difference",
    "numpy_values",
    "small_rows",
    "statistics",
]

SIGNS: Final = 4
COLUMNS: Final = 16
SKETCH: Final = SIGNS * COLUMNS
STATISTICS: Final = ("count", "nan", "inf", "min", "max", "mean", "norm")
"""The named statistics, in the order they start a row; the sketch follows."""

_FLOATS: Final = (torch.float32, torch.float64)
IN_NUMPY: Final = 1 << 13
"""Outputs of at most this many numbers are summarised in NumPy."""


def _splitmix(positions: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = positions * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x2545F4914F6CDD1D)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=64)
def _signs(capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """``SIGNS`` rows of signs and a row of ones, ``capacity`` columns: a row's sign
    depends only on its position, so a shorter matrix is a slice of a longer one."""
    positions = np.arange(capacity * SIGNS, dtype=np.uint64).reshape(SIGNS, capacity)
    bits = (_splitmix(positions) >> np.uint64(63)).astype(np.float64)
    matrix = np.concatenate([1.0 - 2.0 * bits, np.ones((1, capacity))])
    return torch.from_numpy(matrix).to(dtype)


def _capacity(rows: int) -> int:
    """The sign matrix a sketch of ``rows`` rows takes its signs from: its columns."""
    return 1 << max(rows - 1, 1).bit_length()


def _signs_for(rows: int, dtype: torch.dtype) -> torch.Tensor:
    return _signs(_capacity(rows), dtype)[:, :rows]


def statistics(tensor: torch.Tensor) -> np.ndarray | None:
    """The row of :data:`STATISTICS` and the sketch, or ``None`` for a tensor without values
    to read (meta, sparse, quantized, a subclass)."""
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return None
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        return None
    values = tensor.detach()
    if values.is_complex():
        values = torch.view_as_real(values.resolve_conj())
    count = values.numel()
    row = np.zeros(len(STATISTICS) + SKETCH)
    row[0] = count
    if count == 0:
        return row
    array = numpy_values(tensor)
    if array is not None:
        row[:] = small_rows([array])[0]
        return row
    if values.dtype not in _FLOATS:
        values = values.to(torch.float64 if not values.is_floating_point() else torch.float32)
    flat = values.reshape(-1)
    rest = count % COLUMNS
    padded = torch.cat([flat, flat.new_zeros(COLUMNS - rest)]) if rest else flat
    matrix = padded.view(-1, COLUMNS)
    signs = _signs_for(matrix.shape[0], flat.dtype)
    sketch = (signs if flat.is_cpu else signs.to(flat.device)) @ matrix
    low, high = torch.aminmax(flat)
    norm = torch.linalg.vector_norm(flat)
    numbers = torch.cat((sketch.view(-1), torch.stack((low, high, norm)))).cpu().numpy()
    row[len(STATISTICS) :] = numbers[:SKETCH]
    row[3], row[4], row[6] = numbers[-3:]
    row[5] = numbers[SKETCH : SKETCH + COLUMNS].sum(dtype=np.float64) / count
    if not np.isfinite(row[[3, 4, 6]]).all():
        row[1] = int(torch.isnan(flat).sum())
        row[2] = int(torch.isinf(flat).sum())
        if row[1] or row[2]:
            finite = statistics(torch.where(torch.isfinite(flat), flat, flat.new_zeros(())))
            if finite is not None:
                row[5:] = finite[5:]  # the finite values' mean, norm and sketch
    return row


def small_rows(arrays: list[np.ndarray]) -> np.ndarray:
    """:func:`statistics` rows of arrays of 1 to :data:`IN_NUMPY` real numbers each, in float64
    NumPy, all at once: a few microseconds an array, where one call each costs tens.

    Every sum runs over one array's numbers alone, in order (``reduceat``), so an
    array's row is the same whichever arrays it is summarised with.
    """
    parts = [_reals(array) for array in arrays]
    counts = np.array([part.size for part in parts], dtype=np.int64)
    flat = np.concatenate(parts, dtype=np.float64)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rows = -(-counts // COLUMNS)
    first_row = np.concatenate(([0], np.cumsum(rows)[:-1]))
    # Each array's numbers, padded with zeros to whole rows of COLUMNS.
    padded = np.zeros(int(rows.sum()) * COLUMNS)
    padded[np.arange(len(flat)) - np.repeat(starts - first_row * COLUMNS, counts)] = flat
    matrix = padded.reshape(-1, COLUMNS)
    local = np.arange(len(matrix)) - np.repeat(first_row, rows)
    # Each array takes the signs of its own size, as on the torch path and on any device.
    capacities = [_capacity(int(count)) for count in rows]
    by_row = np.repeat(capacities, rows)
    signs = np.empty((SIGNS + 1, len(matrix)))
    for capacity in set(capacities):
        mine = by_row == capacity
        signs[:, mine] = _signs(capacity, torch.float64).numpy()[:, local[mine]]
    result = np.zeros((len(arrays), len(STATISTICS) + SKETCH))
    result[:, 0] = counts
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and Inf are counted below
        sketch = np.add.reduceat(signs[:, :, None] * matrix, first_row, axis=1)
        result[:, 6] = np.sqrt(np.add.reduceat(flat * flat, starts))
    result[:, len(STATISTICS) :] = sketch[:SIGNS].transpose(1, 0, 2).reshape(len(arrays), -1)
    result[:, 3] = np.minimum.reduceat(flat, starts)
    result[:, 4] = np.maximum.reduceat(flat, starts)
    result[:, 5] = sketch[SIGNS].sum(axis=1) / counts
    if not np.isfinite(result[:, [3, 4, 6]]).all():
        result[:, 1] = np.add.reduceat(np.isnan(flat), starts)
        result[:, 2] = np.add.reduceat(np.isinf(flat), starts)
        for index in np.flatnonzero(result[:, 1] + result[:, 2]):
            part = parts[index]
            finite = small_rows([np.where(np.isfinite(part), part, 0.0)])[0]
            result[index, 5:] = finite[5:]  # the finite values' mean, norm and sketch
    return result


def _reals(array: np.ndarray) -> np.ndarray:
    flat = array.reshape(-1)
    return flat.view(flat.real.dtype) if flat.dtype.kind == "c" else flat  # complex: pairs


def numpy_values(tensor: torch.Tensor) -> np.ndarray | None:
    """A C-ordered copy of ``tensor`` in NumPy, as :func:`small_rows` takes it, or ``None``
    unless it is a CPU tensor of 1 to :data:`IN_NUMPY` numbers (complex: 2 a number)."""
    if (
        not (type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter)
        or not tensor.is_cpu
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.dtype not in NUMPY_DTYPES
    ):
        return None
    count = tensor.numel() * (2 if tensor.is_complex() else 1)
    if not 0 < count <= IN_NUMPY:
        return None
    # The copy is torch's: NumPy never sees the tensor's own memory, which torch 2.13 then
    # makes non-resizable for good (FSDP2's reshard fails; see _locate's host_copy).
    values = tensor.detach() if tensor.requires_grad else tensor
    if values.dtype == torch.bool:
        values = values.view(torch.uint8)  # a bool copy would make each non-zero byte 1
    copy = values.clone(memory_format=torch.contiguous_format).numpy(force=True)
    array = np.asarray(copy, order="C")
    return array.view(np.bool_) if tensor.dtype == torch.bool else array


def estimate_difference(sketch_a: np.ndarray, sketch_b: np.ndarray) -> np.ndarray:
    """The estimated L2 norm of ``a - b`` for rows of sketches (last axis ``SKETCH``)."""
    with np.errstate(invalid="ignore", over="ignore"):  # a sketch that overflowed: NaN, inf
        difference = sketch_a - sketch_b
        squares: np.ndarray = np.einsum("...i,...i->...", difference, difference)
        return np.sqrt(squares / SIGNS)
