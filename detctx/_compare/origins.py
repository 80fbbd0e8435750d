"""Which ops past tolerance are origins: the ones whose error is more than their inputs
explain (:mod:`detctx._compare.explained`, per kind of op), or, for kinds without a bound,
more than :data:`GROWTH` times their inputs' largest relative error.
"""

from __future__ import annotations

import functools
from typing import Final

import numpy as np

from detctx._compare.explained import KINDS, Value, explained_error, kind_of
from detctx._compare.format import Trace
from detctx._compare.scalars import scalar_numbers

__all__ = ["GROWTH", "MARGIN", "MASKS", "origins"]

GROWTH: Final = 100.0
"""For an op whose kind has no bound: how many times its inputs' largest relative error
its own must be for it to be an origin. Kernel noise through a nanoGPT step stays within
1e-7..1e-4 (float32), where sums that cancel grow it a few times (a bias gradient: 2x);
a multiply by 1.003 or a rounding to bfloat16 (3e-3, 1.7e-3) is 1,000 times and more the
noise of 1e-6 it meets first in a forward pass."""
MASKS: Final = {"threshold_backward": 1, "hardtanh_backward": 1, "leaky_relu_backward": 1}
"""Ops that pass or stop each element by a mask input (ReLU's backward: the forward's output
at that place): where the mask input carries any error, elements near the threshold can
flip between two runs. A flip changes the count of zeros of the mask (a ReLU's output) or
of the op's output; a change to the op's values does not."""
MARGIN: Final = 2.0
"""How many times the error its inputs explain an op's own must be, where its kind has a
bound, for it to be an origin: the sketch estimates each error within a few percent
(:mod:`detctx._compare.sketch`), the bound is first order."""


def _value(trace: Trace, value: int, error: float) -> Value:
    row = trace.values[value]
    stats = row["stats"]
    return Value(
        float(error),
        abs(float(stats[6])),
        float(stats[3]),
        float(stats[4]),
        float(stats[0]),
        _shape(trace.text(row["shape"])),
        trace.text(row["dtype"]),
    )


@functools.lru_cache(maxsize=4096)
def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(size) for size in text.strip("[]").split(",") if size.strip())
    except ValueError:
        return ()


def _bounds(b: Trace, ops: np.ndarray, absolute: np.ndarray, carried: np.ndarray) -> np.ndarray:
    """Per op of ``ops`` (of B): the absolute error its inputs explain, NaN where none is
    known. ``absolute``: per value of B, ``||a - b||`` (NaN where not estimated, then its
    op's ``carried`` relative error counts)."""
    stats = b.values["stats"]
    found = np.full(len(ops), np.nan)
    for row, op in enumerate(ops.tolist()):
        name = b.text(b.ops["op"][op])
        if b.ops["outputs"][op] != 1 or kind_of(name) not in KINDS:
            continue
        inputs: list[Value | None] = []
        for made in b.inputs[b.first_input[op] : b.first_input[op + 1]].tolist():
            producer, output = int(made[0]), int(made[1])
            if producer < 0:
                inputs.append(None)  # data no recorded op made: its size is not known
                continue
            value = int(b.first_value[producer]) + output
            error = absolute[value]
            if np.isnan(error):
                error = carried[producer] * abs(stats[value, 6])
            inputs.append(_value(b, value, error))
        value = int(b.first_value[op])
        out = _value(b, value, absolute[value])
        scalars = scalar_numbers(b.text(b.ops["scalars"][op]))
        bound = explained_error(name, scalars, inputs, out)
        if bound is not None:
            found[row] = bound
    return found


def origins(
    b: Trace,
    error: np.ndarray,
    absolute: np.ndarray,
    past: np.ndarray,
    estimated: np.ndarray,
    argued: np.ndarray,
    retyped: np.ndarray,
    flipped: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """Which ops of B past tolerance are origins, and every op's input error (its inputs'
    largest relative error, through ops without an estimate up the flow; 0 for data no
    recorded op made). ``error``: per op, relative; ``absolute``: per value, ``||a - b||``;
    ``argued``: ops called with other scalar arguments, origins whatever their inputs;
    ``retyped``: ops with an output of another dtype in A (autocast), whose rounding is
    the change itself, judged by :data:`GROWTH` alone; ``flipped``: per value, whether
    its count of zeros differs from its partner's.

    An op whose kind has a bound (:func:`explained_error`) is an origin when its error
    is more than :data:`MARGIN` times what its inputs explain; any other, when it is
    more than :data:`GROWTH` times its inputs' largest relative error. An op of
    :data:`MASKS` whose mask input carries error and whose mask or output counts other
    zeros in the two runs is not: elements flipped at the threshold explain any error.
    Also returned: what to say of a mask op that stays an origin with error in its mask."""
    carried = np.where(estimated, np.nan_to_num(error, nan=0.0), 0.0)  # what it hands on
    producers = b.inputs["op"]
    starts = b.first_input
    # An op without an estimate hands on what it received: in order, as a chain may run
    # through several (few ops: the rest is one pass below).
    for index in np.flatnonzero(~estimated).tolist():
        made = producers[starts[index] : starts[index + 1]]
        made = made[made >= 0]
        if len(made):
            carried[index] = carried[made].max()
    received = np.zeros(len(b))
    counts = b.ops["inputs"].astype(np.int64)
    if len(producers):
        values = np.where(producers >= 0, carried[np.maximum(producers, 0)], 0.0)
        reading = np.flatnonzero(counts > 0)
        received[reading] = np.maximum.reduceat(values, starts[:-1][reading])
    with np.errstate(invalid="ignore", over="ignore"):
        origin = past & ((error > GROWTH * received) | argued)
    judged = np.flatnonzero(past & ~argued & ~retyped)
    bounds = _bounds(b, judged, absolute, carried)
    has = ~np.isnan(bounds)
    judged, bounds = judged[has], bounds[has]
    own = absolute[b.first_value[judged]]
    with np.errstate(invalid="ignore"):
        origin[judged] = own > MARGIN * bounds
    notes = {}
    for op in np.flatnonzero(origin & ~argued).tolist():
        position = MASKS.get(kind_of(b.text(b.ops["op"][op])))
        if position is None or counts[op] <= position:
            continue
        mask = int(producers[starts[op] + position])
        if mask < 0 or carried[mask] == 0:
            continue
        mask_value = int(b.first_value[mask]) + int(b.inputs["output"][starts[op] + position])
        if flipped[mask_value] or flipped[b.first_value[op]]:
            origin[op] = False  # elements the mask stops in one run and passes in the other
            continue
        notes[op] = (
            f"its mask input carries error {carried[mask]:.3g}, and the mask and this op count "
            "as many zeros in both runs: elements near the threshold that rounding flips "
            "would have flipped as many each way, which the statistics do not tell from a change"
        )
    return origin, received, notes
