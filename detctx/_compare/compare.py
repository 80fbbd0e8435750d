"""Compare one rank's traces within tolerance: each op's estimated error, and whether it is
the origin of the error or inherited it through the data flow.

**Error.** For each output of B paired with an output of A, the estimated
relative error is ``||a - b|| / max(||a||, ||b||)``, ``||a - b||`` from the
sketches (:mod:`detctx._compare.sketch`), the norms exact. Outputs whose
digests are equal have error 0. Integer and bool outputs are compared by
their digests alone: equal bits, or an infinite error. Another shape or
element count, another number of outputs at paired ops, a different count
of NaNs or Infs: each is an infinite error at that op (``differences`` says
which). An op's error is its outputs' largest.

**Pairs.** An op of B paired with an op of A (:mod:`detctx._compare.align`)
compares output with output. An op without a partner (the math kernel's
``bmm`` where A ran the flash kernel) is compared where its value leaves it:
when a paired op reads it, B's value is compared with the value the partner
read in A, whichever A op made it. So a module whose ops do not pair is
still compared at its outputs. An unpaired op whose values reach a paired
op (directly or through other unpaired ops) is *accounted for*: its change
shows in that op's outputs, which are compared. Any other unpaired op, in A
or in B (steps one run has and the other has not, a run cut short, an op
whose result no paired op reads), is *unaccounted*: a difference the
verdict reports, never "agree".

**Origin or inherited.** An op is *past tolerance* when its estimated error
``||a - b||`` exceeds ``atol * sqrt(n) + rtol * ||a||`` (per dtype,
:data:`TOLERANCES`). Its *input error* is the largest error among the
values it reads, as the earlier recorded ops that made them measured them
(through an op without an estimate, the largest of that op's own inputs,
and so on up the flow). An op past tolerance is an *origin* when its error
is more than its inputs can explain for its kind of op
(:mod:`detctx._compare.explained`): it arose in the op itself. Otherwise it
*inherited* its error: an input was past tolerance already, or the op
amplified its inputs' small errors past the line (a sum that cancels, AdamW
dividing a gradient's rounding by eps), which is how rounding noise
accumulates, not a fault of the op. The first origin in B's order is the
one reported; a run whose ops all inherited their error has no origin (the
error grew step by step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Final

import numpy as np

from detctx._compare.align import Alignment, align, fed_by_fused
from detctx._compare.format import Trace
from detctx._compare.origins import origins
from detctx._compare.parting import (
    RANDOM_ADVICE,
    UNSEEN_ADVICE,
    bits_part,
    random_op,
    unseen_differ,
)
from detctx._compare.scalars import scalar_difference
from detctx._compare.sketch import STATISTICS, relative_difference

__all__ = ["TOLERANCES", "RankComparison", "compare_rank", "tolerance_of", "unaccounted"]

TOLERANCES: Final[dict[str, tuple[float, float]]] = {
    "float64": (1e-9, 1e-200),
    "float32": (3e-4, 1e-30),
    "complex64": (3e-4, 1e-30),
    "complex128": (1e-9, 1e-200),
    "float16": (5e-3, 1e-7),
    "bfloat16": (4e-2, 1e-30),
}
"""``dtype -> (rtol, atol)``, on the relative L2 error. Float32's 3e-4 sits between kernel
noise through a whole training step and a real change. Noise: flash against math SDPA in
a nanoGPT step with two AdamW steps (``tests/trace_gpt.py``) stays below 1e-6 in most
ops, and reaches 1.05e-4 in one: the bias of attention's key projection, whose gradient
is zero but for rounding (softmax ignores a constant added to every key), so AdamW's
update of it follows the noise. A float32 tensor rounded to bfloat16 is 1.7e-3 (5.5 times
the tolerance), a multiply by 1.003 is 3e-3. Float16 rounding is 2e-4 and bfloat16's
1.7e-3, so their kernels' noise is that and more. ``atol`` (per element, RMS) only keeps
tensors of zeros from dividing by zero: it sits near the bottom of each dtype's range,
because real values can be tiny everywhere (AdamW's second moments of small gradients
are about 1e-8 in float32). Integer and bool outputs (indices, masks) must be equal."""

_EXACT: Final = (0.0, 0.0)
_NAMED: Final = 10_000
"""At most this many ops a comparison says in words what differs at (shape, outputs)."""
_TINY: Final = 1e-300
_S: Final = len(STATISTICS)


def tolerance_of(dtype: str, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """The tolerances of an output of ``dtype``; ``rtol``/``atol`` override floats'."""
    default = TOLERANCES.get(dtype)
    if default is None:
        return _EXACT
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


@dataclass
class RankComparison:
    """One rank's comparison: per op of B its error, tolerance and kind."""

    rank: int
    a: Trace
    b: Trace
    alignment: Alignment
    error: np.ndarray  # per op of B: estimated relative error, NaN when not estimated
    tolerance: np.ndarray  # per op of B: the relative tolerance its worst output had
    past: np.ndarray  # bool per op of B
    origin: np.ndarray  # bool per op of B (past and not inherited)
    input_error: np.ndarray  # per op of B: the largest error of the values it reads
    at_outputs: np.ndarray  # bool per op of B: compared where its value leaves its module
    bitwise: bool
    retyped: dict[int, tuple[str, str]]  # op of B -> (dtype in A, in B) of an output compared
    differences: dict[int, str]  # op of B -> what differs besides values (shape, outputs, ...)
    unaccounted_a: np.ndarray  # bool per op of A: no partner, and no paired op reads it
    unaccounted_b: np.ndarray  # bool per op of B: likewise
    parted: np.ndarray  # bool per op of B: inputs the same bits as in A, outputs not
    inside: dict[int, str]  # op of B -> the fused module whose unpaired ops' values it reads


def _partners(a: Trace, b: Trace, alignment: Alignment) -> tuple[np.ndarray, np.ndarray]:
    """For every output of B, the output of A it is compared with (or -1), and whether the
    pair was found through the data flow."""
    partner_op = alignment.partner
    value_partner = np.full(len(b.values), -1, dtype=np.int64)
    by_flow = np.zeros(len(b.values), dtype=bool)
    paired = np.flatnonzero(partner_op >= 0)
    same = paired[b.ops["outputs"][paired] == a.ops["outputs"][partner_op[paired]]]
    counts = b.ops["outputs"][same].astype(np.int64)
    if len(same):
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        value_partner[np.repeat(b.first_value[same], counts) + offsets] = (
            np.repeat(a.first_value[partner_op[same]], counts) + offsets
        )
    readers = paired[b.ops["inputs"][paired] == a.ops["inputs"][partner_op[paired]]]
    counts = b.ops["inputs"][readers].astype(np.int64)
    if len(readers) and counts.sum():
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        made_b = b.inputs[np.repeat(b.first_input[readers], counts) + offsets]
        made_a = a.inputs[np.repeat(a.first_input[partner_op[readers]], counts) + offsets]
        useful = (made_b["op"] >= 0) & (made_a["op"] >= 0)
        made_b, made_a = made_b[useful], made_a[useful]
        useful = partner_op[made_b["op"]] != made_a["op"]
        made_b, made_a = made_b[useful], made_a[useful]
        vb = b.first_value[made_b["op"]] + made_b["output"].astype(np.int64)
        va = a.first_value[made_a["op"]] + made_a["output"].astype(np.int64)
        vb, first = np.unique(vb, return_index=True)
        va = va[first]
        keep = [
            _same_order(a.text(int(x)), b.text(int(y)))
            for x, y in zip(a.values["shape"][va], b.values["shape"][vb])
        ]
        vb, va = vb[np.array(keep, dtype=bool)], va[np.array(keep, dtype=bool)]
        free = value_partner[vb] < 0
        value_partner[vb[free]] = va[free]
        by_flow[vb[free]] = True
    return value_partner, by_flow


@functools.lru_cache(maxsize=4096)
def _same_order(shape_a: str, shape_b: str) -> bool:
    """Whether two shapes can hold the same elements in the same logical order: one is the
    other with dimensions merged (``[16, 32, 16]`` and ``[4, 4, 32, 16]``), not permuted
    (the math kernel's ``[4, 4, 16, 32]`` gradient of a transposed key)."""
    if shape_a == shape_b:
        return True
    sizes = []
    for text in (shape_a, shape_b):
        dims = [int(d) for d in text.strip("[]").split(",") if d.strip()]
        products, total = set(), 1
        for dim in reversed([d for d in dims if d != 1]):
            total *= dim
            products.add(total)
        sizes.append(products)
    return max(sizes[0], default=1) == max(sizes[1], default=1) and (
        sizes[0] <= sizes[1] or sizes[1] <= sizes[0]
    )


def compare_rank(
    rank: int, a: Trace, b: Trace, rtol: float | None, atol: float | None
) -> RankComparison:
    alignment = align(a, b)
    partner, by_flow = _partners(a, b, alignment)
    stats_b = b.values["stats"]
    has = partner >= 0
    stats_a = np.zeros_like(stats_b)
    stats_a[has] = a.values["stats"][partner[has]]
    error = np.where(has, relative_difference(stats_a, stats_b), np.nan)
    # An output compared with one of another dtype takes the stricter tolerance: a float32
    # value that B computes in bfloat16 (autocast on one side) is a change, not noise.
    dtypes = _texts(b, b.values["dtype"])
    dtypes_a = dtypes.copy()
    dtypes_a[has] = _texts(a, a.values["dtype"][partner[has]])
    names, which = np.unique(np.concatenate([dtypes_a, dtypes]).astype(str), return_inverse=True)
    table = np.array([tolerance_of(str(name), rtol, atol) for name in names]).reshape(-1, 2)
    exact_names = np.array([str(name) not in TOLERANCES for name in names], dtype=bool)
    which = which.reshape(2, -1)
    rtols = np.minimum(table[which[0], 0], table[which[1], 0])
    atols = np.minimum(table[which[0], 1], table[which[1], 1])
    exact_dtype = exact_names[which[0]] | exact_names[which[1]]
    owner = np.repeat(np.arange(len(b)), b.ops["outputs"].astype(np.int64))
    changed = np.flatnonzero(dtypes_a != dtypes)
    retyped = {int(owner[i]): (str(dtypes_a[i]), str(dtypes[i])) for i in changed}
    norm_a, norm_b = stats_a[:, 6], stats_b[:, 6]
    scale = np.maximum(np.maximum(np.abs(norm_a), np.abs(norm_b)), _TINY)
    with np.errstate(invalid="ignore"):
        allowed = (atols * np.sqrt(stats_b[:, 0]) + rtols * np.abs(norm_a)) / scale
    # Two outputs of zeros: the relative tolerance (atol over a norm of 0 said 1e+271).
    allowed[scale == _TINY] = rtols[scale == _TINY]
    # Equal digests: the same bits, whatever the sketch's rounding (0: not read).
    high_b, low_b = b.values["high"], b.values["low"]
    high_a, low_a = np.zeros_like(high_b), np.zeros_like(low_b)
    high_a[has], low_a[has] = a.values["high"][partner[has]], a.values["low"][partner[has]]
    known = has & ((high_b != 0) | (low_b != 0))
    same_bits = known & (high_a == high_b) & (low_a == low_b)
    differences: dict[int, str] = {}
    # Integer and bool outputs: their bits decide (where they were read; else no estimate).
    exact = has & exact_dtype & known
    error[exact] = np.where(same_bits[exact], 0.0, np.inf)
    error[has & exact_dtype & ~known] = np.nan
    for index in np.flatnonzero(exact & ~same_bits)[:_NAMED]:
        differences.setdefault(int(owner[index]), f"{dtypes[index]} values differ")
    with np.errstate(invalid="ignore"):
        nonfinite = has & (stats_a[:, 1:3] != stats_b[:, 1:3]).any(axis=1)
    error[nonfinite] = np.inf
    for index in np.flatnonzero(nonfinite)[:_NAMED]:
        differences.setdefault(
            int(owner[index]),
            f"NaN and Inf counts {int(stats_a[index, 1])} and {int(stats_a[index, 2])} in A, "
            f"{int(stats_b[index, 1])} and {int(stats_b[index, 2])} in B",
        )
    # Another shape or element count at a paired op (values met through the data flow
    # were paired only where their shapes hold the same elements in the same order).
    direct = has & ~by_flow
    shapes_b = _texts(b, b.values["shape"])
    shapes_a = shapes_b.copy()
    shapes_a[has] = _texts(a, a.values["shape"][partner[has]])
    reshaped = direct & ((shapes_a != shapes_b) | (stats_a[:, 0] != stats_b[:, 0]))
    error[reshaped] = np.inf
    for index in np.flatnonzero(reshaped)[:_NAMED]:
        differences[int(owner[index])] = f"shape {shapes_a[index]} in A, {shapes_b[index]} in B"
    error[same_bits & ~reshaped] = 0.0
    with np.errstate(invalid="ignore"):
        over = has & (error > allowed)
    op_error, op_tolerance = _per_op(b, error, allowed)
    past = np.zeros(len(b), dtype=bool)
    np.logical_or.at(past, owner, over)
    estimated = np.zeros(len(b), dtype=bool)
    np.logical_or.at(estimated, owner, has)
    # Another number of outputs at a paired op: none of its outputs was paired.
    op_partner = alignment.partner
    paired = np.flatnonzero(op_partner >= 0)
    recounted = paired[b.ops["outputs"][paired] != a.ops["outputs"][op_partner[paired]]]
    op_error[recounted] = np.inf
    past[recounted] = estimated[recounted] = True
    for index in recounted[:_NAMED].tolist():
        differences[index] = (
            f"{int(a.ops['outputs'][op_partner[index]])} outputs in A, "
            f"{int(b.ops['outputs'][index])} in B"
        )
    # Other scalar arguments at a paired op (a norm's eps, dropout's p): a change its
    # values may not show, so a difference in itself (floats within the tolerance aside).
    scalars_a = _texts(a, a.ops["scalars"][op_partner[paired]])
    scalars_b = _texts(b, b.ops["scalars"][paired])
    scalar_rtol = tolerance_of("float32", rtol, atol)[0]
    argued = np.zeros(len(b), dtype=bool)
    for index, text_a, text_b in zip(
        paired[scalars_a != scalars_b].tolist(),
        scalars_a[scalars_a != scalars_b].tolist(),
        scalars_b[scalars_a != scalars_b].tolist(),
    ):
        said = scalar_difference(text_a, text_b, scalar_rtol)
        if said is None:
            continue
        # An origin whatever its inputs: its error stays what its values show.
        past[index] = argued[index] = True
        if np.isnan(op_error[index]):
            op_error[index] = np.inf
            estimated[index] = True
        differences.setdefault(index, said)
    at_outputs = np.zeros(len(b), dtype=bool)
    np.logical_or.at(at_outputs, owner, by_flow & has)
    with np.errstate(invalid="ignore", over="ignore"):
        absolute = error * scale
    cast = np.zeros(len(b), dtype=bool)
    cast[list(retyped)] = True
    flipped = has & np.isfinite(stats_b[:, 7]) & (stats_a[:, 7] != stats_b[:, 7])
    origin, input_error, notes = origins(
        b, op_error, absolute, past, estimated, argued, cast, flipped
    )
    for index, note in notes.items():
        differences.setdefault(index, note)
    bitwise = (
        len(a) == len(b)
        and alignment.aligned == len(b)
        and bool((a.ops["high"][op_partner] == b.ops["high"]).all())
        and bool((a.ops["low"][op_partner] == b.ops["low"]).all())
    )
    lonely_a, lonely_b = unaccounted(a, b, op_partner)
    # Inside a module run as a fused kernel on one side and as its parts on the other,
    # values no op reads on either side (an LSTM's final states the model drops) are not
    # compared: what the module hands on is, where paired ops read it. Only where both
    # sides leave such values: ops one side adds whose values nothing reads still differ.
    for lo_a, hi_a, lo_b, hi_b in alignment.fused:
        if lonely_a[lo_a:hi_a].any() and lonely_b[lo_b:hi_b].any():
            lonely_a[lo_a:hi_a] = False
            lonely_b[lo_b:hi_b] = False
    parted = bits_part(a, b, op_partner, partner, same_bits)
    for index in np.flatnonzero(unseen_differ(a, b, op_partner))[:_NAMED].tolist():
        differences.setdefault(index, UNSEEN_ADVICE)
    for index in np.flatnonzero(parted)[:_NAMED].tolist():
        if random_op(b.text(b.ops["op"][index])):
            differences.setdefault(index, RANDOM_ADVICE)
    return RankComparison(
        rank,
        a,
        b,
        alignment,
        op_error,
        op_tolerance,
        past,
        origin,
        input_error,
        at_outputs,
        bitwise,
        retyped,
        differences,
        lonely_a,
        lonely_b,
        parted,
        fed_by_fused(b, alignment),
    )


def _texts(trace: Trace, numbers: np.ndarray) -> np.ndarray:
    """The strings ``numbers`` name in ``trace``, as an object array."""
    table = np.array(trace.strings, dtype=object)
    return table[numbers] if len(numbers) else np.zeros(0, dtype=object)


def unaccounted(a: Trace, b: Trace, op_partner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per op of A and of B: it has no partner, and none of its values reaches a paired op
    (directly or through other unpaired ops), whose compared outputs would show it."""
    paired_b = op_partner >= 0
    paired_a = np.zeros(len(a), dtype=bool)
    paired_a[op_partner[paired_b]] = True
    return _spread(a, paired_a), _spread(b, paired_b)


def _spread(trace: Trace, paired: np.ndarray) -> np.ndarray:
    """Unpaired ops whose values reach no paired op: from the last op back, an unpaired op
    that reaches one passes that on to the ops that made its inputs."""
    producers = trace.inputs["op"]
    starts = trace.first_input
    reach = np.zeros(len(trace), dtype=bool)
    readers = np.repeat(paired, trace.ops["inputs"].astype(np.int64))
    made = producers[readers]
    reach[made[made >= 0]] = True
    for op in np.flatnonzero(~paired)[::-1].tolist():
        if reach[op]:
            made = producers[starts[op] : starts[op + 1]]
            reach[made[made >= 0]] = True
    lonely: np.ndarray = ~paired & ~reach
    return lonely


def _per_op(b: Trace, error: np.ndarray, allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each op's largest output error and the tolerance of that output (every recorded op has
    an output; NaN where none of its outputs has an estimate)."""
    if not len(b):
        return np.zeros(0), np.zeros(0)
    starts = b.first_value[:-1]
    counts = b.ops["outputs"].astype(np.int64)
    filled = np.where(np.isnan(error), -np.inf, error)
    worst = np.maximum.reduceat(filled, starts)
    at_worst = filled == np.repeat(worst, counts)
    tolerance = np.maximum.reduceat(np.where(at_worst, allowed, -np.inf), starts)
    none = worst == -np.inf
    worst[none], tolerance[none] = np.nan, np.nan
    return worst, tolerance

