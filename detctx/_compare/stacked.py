"""Each output's row of statistics (:func:`statistics`; the sketch's numbers are made in
:mod:`detctx._compare.sketch`), and rows and digests of many outputs' copies at once: digests
in a staging buffer (:func:`staged_digests`), rows of large float32 outputs of one size
stacked and measured together (:func:`float_rows`: one product, one amin and amax, one norm
a size), each row the one :func:`statistics` gives the output alone (the stacked calls
reduce each output's numbers by themselves; the tests check it bit for bit). Some 55 us an
output of 64 KiB instead of some 200: the calls into torch and NumPy, not the arithmetic,
were most of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import numpy as np
import torch

from detctx._compare.sketch import (
    COLUMNS,
    FLOATS,
    IN_NUMPY,
    SAFE,
    SIGNS,
    SKETCH,
    SKETCH_AT,
    STATISTICS,
    fill_row,
    measure,
    numpy_values,
    scale_of,
    sign_folds,
    signs_for,
    small_rows,
)
from detctx._locate import (
    ROW_BYTES,
    SMALL,
    STAGED,
    DigestKey,
    Staging,
    stacked_digests,
    tensor_digest,
)

__all__ = ["copy_summaries", "float_rows", "staged_digests", "statistics"]

_STACK_BYTES: Final = 16 << 20
"""Bytes of tensors :func:`float_rows` stacks into one copy, at most."""
_ALONE_BYTES: Final = 1 << 20
"""A tensor of at least this many bytes is measured alone: for it the calls cost little
beside the arithmetic, and a stack's copy leaves the cache (4 MiB ones: some 3.6 ms
each stacked, 1.7 alone)."""


def float_rows(tensors: list[torch.Tensor], *, own: bool = False) -> list[np.ndarray | None]:
    """:func:`statistics` rows of contiguous float32 CPU tensors of more than
    :data:`IN_NUMPY` numbers, many at a time: tensors of one size are stacked and
    measured together (one product, one ``aminmax``, one norm a size), each row the one
    the tensor has alone (the batched calls reduce each tensor's numbers by themselves).
    ``None`` where a tensor needs :func:`statistics` itself (NaN or Inf in it, values
    outside ``2**±40``, another dtype or layout). ``own``: the tensors are detctx's own
    copies, which NumPy may read in place (else a tensor alone is copied for it)."""
    return _measured(tensors, own=own, key=None)[0]


def copy_summaries(
    staging: Staging, copies: list[torch.Tensor]
) -> tuple[list[np.ndarray | None], list[int]]:
    """:func:`float_rows` of detctx's own ``copies`` and their digests under ``staging``'s key,
    each the one the copy has alone. Float32 copies stacked for their rows whose bytes are
    whole rows of one reduce step are digested from that stack (no copy into ``staging``),
    others in ``staging`` (left empty) where it takes them, the rest one by one."""
    rows, made = _measured(copies, own=True, key=staging.key)
    staged = [done is None and copy.nbytes <= STAGED for copy, done in zip(copies, made)]
    large = iter(staged_digests(staging, [c for c, in_stage in zip(copies, staged) if in_stage]))
    digests = []
    for copy, done, in_stage in zip(copies, made, staged):
        if done is None:
            done = next(large) if in_stage else tensor_digest(copy, key=staging.key, own=True) or 0
        digests.append(done)
    return rows, digests


def _measured(
    tensors: list[torch.Tensor], *, own: bool, key: DigestKey | None
) -> tuple[list[np.ndarray | None], list[int | None]]:
    rows: list[np.ndarray | None] = [None] * len(tensors)
    digests: list[int | None] = [None] * len(tensors)
    sizes: dict[int, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if (
            type(tensor) is torch.Tensor
            and tensor.dtype == torch.float32
            and tensor.is_cpu
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
            and tensor.numel() > IN_NUMPY
        ):
            sizes.setdefault(tensor.numel(), []).append(index)
    for count, members in sizes.items():
        per_stack = 1 if 4 * count >= _ALONE_BYTES else _STACK_BYTES // (4 * count)
        whole = key is not None and not 4 * count % ROW_BYTES and SMALL < 4 * count <= STAGED
        for start in range(0, len(members), per_stack):
            chosen = members[start : start + per_stack]
            flat = (
                tensors[chosen[0]].view(1, -1)
                if len(chosen) == 1
                else torch.stack([tensors[index].view(-1) for index in chosen])
            )
            for index, row in zip(chosen, _stacked_rows(flat, own)):
                rows[index] = row
            if whole and key is not None:
                shapes = [tuple(tensors[index].shape) for index in chosen]
                for index, made in zip(chosen, stacked_digests(flat, shapes, key)):
                    digests[index] = made
    return rows, digests


def _stacked_rows(flat: torch.Tensor, own: bool) -> list[np.ndarray | None]:
    """Rows of each of the ``k`` tensors laid out in ``flat`` (``k x n``, float32)."""
    k, count = flat.shape
    rest = count % COLUMNS
    padded = torch.cat([flat, flat.new_zeros(k, COLUMNS - rest)], dim=1) if rest else flat
    matrix = padded.view(k, -1, COLUMNS)
    signs = signs_for(matrix.shape[1], torch.float32)
    # One tensor: a plain product (a batch of one costs twice as much); the same sums.
    sums = (signs @ matrix[0]).unsqueeze(0) if k == 1 else torch.matmul(signs, matrix)
    # min and max are exact in any order; amin and amax along a dim run some ten times
    # faster than aminmax along one.
    low, high = torch.aminmax(flat[0]) if k == 1 else (flat.amin(dim=1), flat.amax(dim=1))
    low, high = low.reshape(k), high.reshape(k)
    norm = torch.linalg.vector_norm(flat, dim=1)
    # NumPy counts zeros some ten times faster than torch on a CPU; it reads detctx's own
    # memory only (a stack is a copy), as a program's tensor NumPy has seen cannot be
    # resized again.
    mine = flat if own or k > 1 else flat.clone()
    zeros = np.array([np.count_nonzero(row == 0) for row in mine.numpy()])
    sums_64 = sums.numpy().astype(np.float64)
    low_64, high_64 = low.numpy().astype(np.float64), high.numpy().astype(np.float64)
    norm_64 = norm.numpy().astype(np.float64)
    largest = np.maximum(np.abs(low_64), np.abs(high_64))
    usable = (
        np.isfinite(low_64)
        & np.isfinite(high_64)
        & ((largest == 0) | ((largest >= 2.0**-SAFE) & (largest <= 2.0**SAFE)))
    )
    result = np.zeros((k, len(STATISTICS) + SKETCH))
    result[:, 0] = count
    result[:, 3], result[:, 4] = low_64, high_64
    result[:, 6] = norm_64
    result[:, 7] = zeros
    # An output with NaN or Inf (its row is not used: statistics() measures it) makes NaN
    # and Inf here, which NumPy would warn of at the program's line.
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        result[:, 5] = sums_64[:, SIGNS].sum(axis=1) / count
        folded = np.matmul(sums_64[:, :SIGNS, None, :], sign_folds()[None]).reshape(k, -1)
        result[:, SKETCH_AT:] = np.where(norm_64[:, None] > 0, folded / norm_64[:, None], 0.0)
    return [result[i] if usable[i] else None for i in range(k)]


def staged_digests(staging: Staging, copies: Sequence[np.ndarray | torch.Tensor]) -> list[int]:
    """The digests of outputs' copies (detctx's own: read in place), many at a time in
    ``staging`` (left empty), each the one the output has alone."""
    digests: list[int] = []
    for array in copies:
        copy = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        if not staging.room_for([copy]):
            digests.extend(_take(staging))
        staging.add(copy, owned=True)
    digests.extend(_take(staging))
    return digests


def _take(staging: Staging) -> list[int]:
    high, low = staging.digests()
    staging.clear()
    return [(int(first) << 64) | int(second) for first, second in zip(high, low)]


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
    if values.dtype not in FLOATS:
        values = values.to(torch.float64 if not values.is_floating_point() else torch.float32)
    flat = values.reshape(-1)
    if flat.dtype == torch.float32 and flat.is_cpu:
        (batched,) = float_rows([flat])  # the row it gets when summarised with others
        if batched is not None:
            return batched
    numbers = measure(flat)
    row[7] = numbers[-4]  # of the values as they are (below, NaN and Inf become zeros)
    low, high = numbers[-3], numbers[-2]
    if not (math.isfinite(low) and math.isfinite(high)):
        finite = torch.isfinite(flat)
        row[1] = int(torch.isnan(flat).sum())
        row[2] = count - int(finite.sum()) - row[1]
        if row[1] + row[2] == count:
            return row  # no finite value: min, max, mean, norm and sketch stay 0
        flat = torch.where(finite, flat, flat.new_zeros(()))
        low = float(torch.where(finite, flat, flat.new_full((), math.inf)).min())
        high = float(torch.where(finite, flat, flat.new_full((), -math.inf)).max())
        numbers = measure(flat)
    row[3], row[4] = low, high
    scale = scale_of(max(abs(low), abs(high)), SAFE)
    if scale != 1.0:
        numbers = measure(flat.to(torch.float64) * scale)
    fill_row(row, numbers, scale)
    return row
