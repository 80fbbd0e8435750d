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
outputs by count) are summarised in float64 NumPy. Which of the two an
output takes depends only on its device, dtype and size, so equal bits give
equal sketches on one machine; the tolerance comparison never rests on
differences that small. Bitwise equality is decided by the digest, not by
the sketch.

**What it cannot see.** A difference confined to a few elements whose
signs happen to cancel in every row of ``S`` (probability ``2**-SIGNS`` for
one element; none for a single element, whose change always shows), and
anything about *where* in the tensor the difference lies.

Cost: one small matrix product (0.6 to 1.2 ms for 2 million float32 numbers
on one CPU core, two to four times an elementwise multiply), ``aminmax`` and
a norm: three reads of the output; a few microseconds for a small output.
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


def _signs_for(rows: int, dtype: torch.dtype) -> torch.Tensor:
    capacity = 1 << max(rows - 1, 1).bit_length()
    return _signs(capacity, dtype)[:, :rows]


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
    if count <= IN_NUMPY and values.is_cpu and values.dtype in NUMPY_DTYPES:
        _small_statistics(values.numpy(force=True), row)
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
    return row


def _small_statistics(array: np.ndarray, row: np.ndarray) -> None:
    """:func:`statistics` of at most :data:`IN_NUMPY` numbers, in float64 NumPy (a few
    microseconds a call, where torch's calls cost tens)."""
    flat = array.reshape(-1).astype(np.float64)
    count = len(flat)
    rest = count % COLUMNS
    padded = np.concatenate([flat, np.zeros(COLUMNS - rest)]) if rest else flat
    matrix = padded.reshape(-1, COLUMNS)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and Inf are counted below
        sketch = _signs_for(len(matrix), torch.float64).numpy() @ matrix
        row[6] = np.sqrt(flat @ flat)
    row[len(STATISTICS) :] = sketch[:SIGNS].reshape(-1)
    row[3], row[4] = flat.min(), flat.max()
    row[5] = sketch[SIGNS].sum() / count
    if not np.isfinite(row[[3, 4, 6]]).all():
        row[1] = np.isnan(flat).sum()
        row[2] = np.isinf(flat).sum()


def estimate_difference(sketch_a: np.ndarray, sketch_b: np.ndarray) -> np.ndarray:
    """The estimated L2 norm of ``a - b`` for rows of sketches (last axis ``SKETCH``)."""
    difference = sketch_a - sketch_b
    squares: np.ndarray = np.einsum("...i,...i->...", difference, difference)
    return np.sqrt(squares / SIGNS)
