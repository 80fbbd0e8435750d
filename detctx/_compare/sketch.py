"""Per-output statistics and a sketch from which two runs' relative error is estimated.

Every recorded output gets a fixed-size row of float64 numbers
(:data:`STATISTICS` names them): its element count, NaN and Inf counts, the
min, max and mean of its finite values, their L2 norm, its count of zeros
(an element a mask stops in one run and passes in the other changes it; a
value scaled or rounded does not), and a sketch of :data:`SKETCH` numbers.

**The sketch.** The output, read in logical order as ``n`` numbers (padded
with zeros to a multiple of :data:`COLUMNS`), is laid out as a matrix ``X``
of ``n / COLUMNS`` rows and :data:`COLUMNS` columns. Each of :data:`SIGNS`
*repeats* ``k`` multiplies ``X`` by a row of random signs ``s_k`` (one per
row of ``X``) and the resulting row of :data:`COLUMNS` sums by a
``COLUMNS x FOLDS`` matrix of random signs ``T_k``: ``Z_k = (s_k @ X) @ T_k``,
:data:`FOLDS` numbers. The sketch is the ``SIGNS x FOLDS`` numbers ``Z``,
divided by the output's norm. Every sign is drawn from a hash of
:data:`KEY` and its place (repeat and row, or repeat, column and fold), so
every machine, torch and NumPy release draws the same. Element ``(r, c)``
enters every number of repeat ``k`` with the sign ``s_k[r] * T_k[c, j]``. It
is linear, so A's sketch minus B's is the sketch of the difference
``d = a - b``, and

    ||d||^2  ~  sum((Z_A - Z_B)^2) / (SIGNS * FOLDS)

is an unbiased estimate for any ``d``.

**What it sees.** Two elements of ``X`` enter a repeat with independent
signs unless they share a row (then ``T_k`` tells them apart: ``FOLDS``
independent signs) or a column (then ``s_k``: one). So a difference in two
elements, the hardest few-element case (two values swapped, one moved),
shows in about half the repeats at least, and its estimate is below a
third of its size only when at most one of the ``SIGNS`` repeats sees it:
probability ``(SIGNS + 1) / 2**SIGNS = 2**-21.2``; a difference spread over
rows is seen in every repeat. The probability is over the key: a
difference made to fit the public key can hide, one that arises in a
program cannot. ``tests/test_trace_verdict.py`` swaps 2,000 pairs and
every pair of rows of an output. Integer and bool outputs do not rest on
this: they are compared by their digests, bit for bit.

**How accurate.** The squared estimate's relative standard deviation is
about ``sqrt(2 / (SIGNS * FOLDS)) = 0.14`` for a difference spread over
many elements (rounding noise, a scaled tensor, a changed kernel), so the
norm is within about 7%; the tests check it on drawn differences. That is
enough for what it decides: whether an error is above or below a tolerance
that sits orders of magnitude from both kernel noise and a real change (see
:data:`detctx._compare.compare.TOLERANCES`).

**Ranges.** The norm and the sketch are measured on the output scaled by a
power of two (exact) whenever its largest magnitude lies outside
``2**-40 .. 2**40`` (``2**-400 .. 2**400`` on the float64 NumPy path), then
scaled back in float64: no finite value overflows or underflows them, so
20,000 values near 1e20 are compared as any others. The sketch is stored
divided by the norm; the compare needs only the ratio.

Float32 outputs of more than :data:`IN_NUMPY` numbers are sketched in
float32 (one BLAS product, ``(SIGNS + 1) x rows`` by ``rows x COLUMNS``):
its own rounding, about ``2**-24`` of the column norms, is below every
float32 tolerance; smaller outputs (most ops' outputs by count) are
summarised in float64 NumPy, many at a time (:func:`small_rows`), each sum
running over one output's numbers alone. Which of the two an output takes
depends only on its device, dtype and size, so equal bits give equal
sketches on one machine; bitwise equality is decided by the digest, not by
the sketch.

**NaN and Inf.** An output holding them (an attention mask of ``-inf``) is
counted (NaN, Inf), and its min, max, mean, norm, count of zeros and sketch
are those of its finite values (in the sketch, the others taken as zeros;
all zero when it has none): a difference among its finite values shows as
in any other output, one in where the NaN and Inf lie does not (only their
counts are compared).

Cost: one matrix product of ``SIGNS + 1`` multiply-adds an element (about
1.7 ms for 2 million float32 numbers on one CPU core, twice an elementwise
multiply), ``aminmax``, a norm and a count of zeros: four reads of the output; some ten
microseconds for a small output summarised with others.
"""

from __future__ import annotations

import functools
import math
from typing import Final

import numpy as np
import torch

from detctx._locate import NUMPY_DTYPES

__all__ = [
    "COLUMNS",
    "FLOATS",
    "FOLDS",
    "IN_NUMPY",
    "KEY",
    "SAFE",
    "SIGNS",
    "SKETCH",
    "SKETCH_AT",
    "STATISTICS",
    "WIDENED",
    "fill_row",
    "measure",
    "numpy_values",
    "relative_difference",
    "scale_of",
    "sign_folds",
    "signs_for",
    "sketch_bound",
    "small_rows",
]

SIGNS: Final = 26
"""Repeats: each element enters the sketch with this many independent row signs."""
COLUMNS: Final = 64
FOLDS: Final = 4
"""Numbers each repeat keeps: its ``COLUMNS`` sums folded by random signs."""
SKETCH: Final = SIGNS * FOLDS
KEY: Final = 0x6465746374782D33
"""The public key the signs are drawn from (written in each trace's header; traces of
another key, or another sketch shape, are not compared)."""
STATISTICS: Final = ("count", "nan", "inf", "min", "max", "mean", "norm", "zeros")
"""The named statistics, in the order they start a row; the sketch follows."""

FLOATS: Final = (torch.float32, torch.float64)
WIDENED: Final = frozenset(
    getattr(torch, name)
    for name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)
"""Float dtypes NumPy has not whose every value float32 holds exactly: small outputs of
these are summarised from their float32 values (their digests read their own bits)."""
IN_NUMPY: Final = 1 << 13
"""Outputs of at most this many numbers are summarised in NumPy."""
SAFE: Final = 40
"""The torch path measures outputs whose largest magnitude is within ``2**-40 .. 2**40``
as they are, others scaled by a power of two: a float32 sum of squares stays in range."""
_SAFE_IN_NUMPY: Final = 400
SKETCH_AT: Final = len(STATISTICS)


def _splitmix(positions: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = positions * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x2545F4914F6CDD1D)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _sign_bits(places: np.ndarray) -> np.ndarray:
    return 1.0 - 2.0 * (_splitmix(places ^ np.uint64(KEY)) >> np.uint64(63)).astype(np.float64)


@functools.lru_cache(maxsize=64)
def _signs(capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """``SIGNS`` rows of row signs and a row of ones, ``capacity`` columns: a sign depends
    only on the key, its repeat and its row, so a shorter matrix is a slice of a longer one."""
    repeats = np.arange(SIGNS, dtype=np.uint64)[:, None] << np.uint64(48)
    signs = _sign_bits(repeats | np.arange(capacity, dtype=np.uint64))
    return torch.from_numpy(np.concatenate([signs, np.ones((1, capacity))])).to(dtype)


@functools.cache
def sign_folds() -> np.ndarray:
    """``T``: per repeat, a ``COLUMNS x FOLDS`` matrix of signs (float64)."""
    places = np.arange(SIGNS * COLUMNS * FOLDS, dtype=np.uint64) | (np.uint64(1) << np.uint64(62))
    return _sign_bits(places).reshape(SIGNS, COLUMNS, FOLDS)


def _capacity(rows: int) -> int:
    """The sign matrix a sketch of ``rows`` rows takes its signs from: its columns."""
    return 1 << max(rows - 1, 1).bit_length()


def signs_for(rows: int, dtype: torch.dtype) -> torch.Tensor:
    return _signs(_capacity(rows), dtype)[:, :rows]


def sketch_bound(count: np.ndarray) -> np.ndarray:
    """The largest magnitude a stored (norm-divided) sketch number of an output of ``count``
    numbers can have: ``|sum_i (+-1) x_i| <= sqrt(n) ||x||`` (Cauchy-Schwarz)."""
    padded = -(-np.asarray(count, dtype=np.float64) // COLUMNS) * COLUMNS
    return np.asarray(np.sqrt(np.maximum(padded, 1.0)))


def scale_of(largest: float, safe: int) -> float:
    """A power of two that brings ``largest`` near 1 when it is outside ``2**±safe``, else 1."""
    if largest == 0.0 or 2.0**-safe <= largest <= 2.0**safe:
        return 1.0
    return math.ldexp(1.0, -min(max(math.frexp(largest)[1], -1000), 1000))


def measure(flat: torch.Tensor) -> np.ndarray:
    """The ``SIGNS + 1`` rows of signed column sums (then the plain ones), then the count of
    zeros, min, max and norm, as float64."""
    rest = flat.numel() % COLUMNS
    padded = torch.cat([flat, flat.new_zeros(COLUMNS - rest)]) if rest else flat
    matrix = padded.view(-1, COLUMNS)
    signs = signs_for(matrix.shape[0], flat.dtype)
    sums = (signs if flat.is_cpu else signs.to(flat.device)) @ matrix
    low, high = torch.aminmax(flat)
    norm = torch.linalg.vector_norm(flat)
    if flat.is_cpu:  # NumPy counts some ten times faster, on a copy (a program's tensor
        # NumPy has seen cannot be resized again)
        zeros = torch.tensor(np.count_nonzero(flat.clone().numpy() == 0), dtype=torch.float64)
    else:  # counted exactly: float32 rounds past 2**24
        zeros = (flat == 0).sum(dtype=torch.int64).double()
    ends = torch.stack((zeros, low.double(), high.double(), norm.double()))
    numbers = torch.cat((sums.view(-1).double(), ends)).cpu()
    return numbers.numpy()


def fill_row(row: np.ndarray, numbers: np.ndarray, scale: float) -> None:
    """Mean, norm and norm-divided sketch from :func:`measure`'s numbers of an output
    multiplied by ``scale`` (a power of two)."""
    sums = numbers[: (SIGNS + 1) * COLUMNS].reshape(SIGNS + 1, COLUMNS)
    norm = float(numbers[-1])
    row[5] = float(sums[SIGNS].sum()) / scale / (row[0] - row[1] - row[2])
    row[6] = norm / scale
    if norm > 0.0:
        row[SKETCH_AT:] = np.matmul(sums[:SIGNS, None, :], sign_folds()).reshape(-1) / norm


def small_rows(arrays: list[np.ndarray]) -> np.ndarray:
    """:func:`statistics` rows of arrays of 1 to :data:`IN_NUMPY` real numbers each, in float64
    NumPy, all at once: a few microseconds an array, where one call each costs tens.

    Every sum runs over one array's numbers alone, so an array's row is the same
    whichever arrays it is summarised with.
    """
    parts = [_reals(array) for array in arrays]
    flat = np.concatenate(parts, dtype=np.float64)
    result = _rows(flat, np.array([part.size for part in parts], dtype=np.int64))
    finite = np.isfinite(result[:, 3:5]).all(axis=1)
    if not finite.all():
        result[:, 1] = np.add.reduceat(np.isnan(flat), _starts(result))
        result[:, 2] = np.add.reduceat(np.isinf(flat), _starts(result))
        for index in np.flatnonzero(~finite):
            part = parts[index].astype(np.float64)
            kept = np.isfinite(part)
            row = result[index]
            zeros = row[7]  # NaN is no zero: the count is the finite values' already
            row[3:] = 0.0
            if kept.any():
                row[3:] = small_rows([np.where(kept, part, 0.0)])[0][3:]
                row[3], row[4] = part[kept].min(), part[kept].max()
                row[5] *= part.size / kept.sum()  # the mean of the finite values
            row[7] = zeros
    largest = np.maximum(np.abs(result[:, 3]), np.abs(result[:, 4]))
    for index in np.flatnonzero(
        (largest > 2.0**_SAFE_IN_NUMPY) | ((largest > 0) & (largest < 2.0**-_SAFE_IN_NUMPY))
    ):
        scale = scale_of(float(largest[index]), _SAFE_IN_NUMPY)
        part = np.where(np.isfinite(parts[index]), parts[index], 0.0).astype(np.float64)
        scaled = _rows(part * scale, np.array([part.size], dtype=np.int64))[0]
        row = result[index]
        row[5], row[6] = scaled[5] / scale, scaled[6] / scale
        row[SKETCH_AT:] = scaled[SKETCH_AT:]
    return result


def _starts(result: np.ndarray) -> np.ndarray:
    counts = result[:, 0].astype(np.int64)
    return np.concatenate(([0], np.cumsum(counts)[:-1]))


def _rows(flat: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Rows of the arrays laid end to end in ``flat`` (``counts`` numbers each), without
    telling NaN and Inf apart or scaling (:func:`small_rows` does both)."""
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rows = -(-counts // COLUMNS)
    first_row = np.concatenate(([0], np.cumsum(rows)[:-1]))
    # Each array's numbers, padded with zeros to whole rows of COLUMNS.
    padded = np.zeros(int(rows.sum()) * COLUMNS)
    padded[np.arange(len(flat)) - np.repeat(starts - first_row * COLUMNS, counts)] = flat
    matrix = padded.reshape(-1, COLUMNS)
    sums = np.empty((len(counts), SIGNS + 1, COLUMNS))
    result = np.zeros((len(counts), len(STATISTICS) + SKETCH))
    result[:, 0] = counts
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and Inf: small_rows counts them
        # Arrays of one number of rows at a time: one product of a stack of them each.
        for size in np.unique(rows).tolist():
            mine = np.flatnonzero(rows == size)
            block = matrix[first_row[mine][:, None] + np.arange(size)]
            signs = _signs(_capacity(size), torch.float64).numpy()[:, :size]
            sums[mine] = np.matmul(signs, block)
        norm = np.sqrt(np.add.reduceat(flat * flat, starts))
        result[:, 3] = np.minimum.reduceat(flat, starts)
        result[:, 4] = np.maximum.reduceat(flat, starts)
        result[:, 5] = sums[:, SIGNS].sum(axis=1) / counts
        result[:, 6] = norm
        result[:, 7] = np.add.reduceat(flat == 0, starts)
        # A product per array and repeat, so each array's numbers are the ones it has
        # alone (one product over all arrays could sum in another order for another count).
        folded = np.matmul(sums[:, :SIGNS, None, :], sign_folds()[None]).reshape(len(counts), -1)
        result[:, SKETCH_AT:] = folded / np.where(norm > 0, norm, 1.0)[:, None]
    return result


def _reals(array: np.ndarray) -> np.ndarray:
    flat = array.reshape(-1)
    return flat.view(flat.real.dtype) if flat.dtype.kind == "c" else flat  # complex: pairs


def numpy_values(tensor: torch.Tensor) -> np.ndarray | None:
    """A C-ordered copy of ``tensor`` in NumPy, as :func:`small_rows` takes it, or ``None``
    unless it is a CPU tensor of 1 to :data:`IN_NUMPY` numbers (complex: 2 a number). A
    dtype NumPy has not (bfloat16, the float8 types) comes as its float32 values, which are
    exactly its own."""
    if (
        not (type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter)
        or not tensor.is_cpu
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or (tensor.dtype not in NUMPY_DTYPES and tensor.dtype not in WIDENED)
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
    if values.dtype in WIDENED:
        copy = values.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    else:
        copy = values.clone(memory_format=torch.contiguous_format)
    array = np.asarray(copy.numpy(force=True), order="C")
    return array.view(np.bool_) if tensor.dtype == torch.bool else array


def relative_difference(stats_a: np.ndarray, stats_b: np.ndarray) -> np.ndarray:
    """The estimated ``||a - b|| / max(||a||, ||b||)`` for rows of statistics (last axis a
    row of :data:`STATISTICS` and the sketch); 0 where both norms are 0."""
    norm_a, norm_b = stats_a[..., 6:7], stats_b[..., 6:7]
    largest = np.maximum(norm_a, norm_b)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        share_a = np.where(largest > 0, norm_a / largest, 0.0)
        share_b = np.where(largest > 0, norm_b / largest, 0.0)
        difference = share_a * stats_a[..., SKETCH_AT:] - share_b * stats_b[..., SKETCH_AT:]
        squares: np.ndarray = np.einsum("...i,...i->...", difference, difference)
        return np.sqrt(squares / SKETCH)
