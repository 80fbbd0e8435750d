"""Where the bits first part: an op whose inputs are the same bits in both runs and whose
outputs are not.

That is the strongest evidence a pair of traces holds: whatever the sizes, the
op itself (its kernel, its arguments, its code) computed something else from
the same data. It is found from the digests alone, so it is seen even where
every op is within tolerance (a GELU switched to its tanh form: 5e-5 at the
op, under float32's 3e-4). An input counts as the same bits when the data
flow lines it up with the value the partner read in A (the output of the
partner of the op that made it) and their digests are equal (the tensor a
random op fills in place is written, not read, and does not count). Data no
recorded op made and that has no row of its own (the batch, memory allocated
where the recorder does not see it) counts when both runs read it at that
place and its digests, taken as it was read, are equal; where they differ,
:func:`unseen_differ` names the op. A random op whose inputs agree and whose
draws do not is named as such: its generator draws other numbers (another
torch release or device), and the advice points at portable draws
(:mod:`detctx._compare.portable`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from detctx._compare.format import READ_OP, STATE_OP, Trace

__all__ = ["RANDOM_ADVICE", "UNSEEN_ADVICE", "bits_part", "random_op", "unseen_differ"]

RANDOM_ADVICE = (
    "a random op whose inputs are the same bits: the generators draw differently (each "
    "torch release and device draws its own numbers from one seed); record both runs with "
    "one portable seed (detctx record --portable-random SEED, detctx.recording(..., "
    "portable_random=SEED)) so that they draw the same, or compare runs of one release and "
    "device there (two portable recordings draw differently only with other seeds, or "
    "where one ran other random ops before)"
)

UNSEEN_ADVICE = (
    "it reads data no recorded op made (a batch from NumPy or a DataLoader worker, memory "
    "allocated where the recorder does not see it) whose bits differ from what A read here"
)


def _read_pairs(
    a: Trace, b: Trace, op_partner: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The paired ops of B that read as many tensors as their partners, their input rows
    and their partners', and how many inputs each reads."""
    paired = op_partner >= 0
    partner = np.maximum(op_partner, 0)
    counts = b.ops["inputs"].astype(np.int64)
    readers = np.flatnonzero(paired & (counts == a.ops["inputs"][partner]))
    many = counts[readers]
    offsets = np.arange(many.sum()) - np.repeat(np.cumsum(many) - many, many)
    made_b = b.inputs[np.repeat(b.first_input[readers], many) + offsets]
    made_a = a.inputs[np.repeat(a.first_input[partner[readers]], many) + offsets]
    return readers, made_a, made_b, many


def _unseen_same(made_a: np.ndarray, made_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per input pair: both are data no recorded op made, with digests equal; with
    digests that differ."""
    both = (made_a["op"] < 0) & (made_b["op"] < 0)
    both &= ((made_a["high"] != 0) | (made_a["low"] != 0)) & (
        (made_b["high"] != 0) | (made_b["low"] != 0)
    )
    same = (made_a["high"] == made_b["high"]) & (made_a["low"] == made_b["low"])
    return both & same, both & ~same


def unseen_differ(a: Trace, b: Trace, op_partner: np.ndarray) -> np.ndarray:
    """Per op of B: it reads data no recorded op made whose digest differs from what its
    partner read at that place."""
    found = np.zeros(len(b), dtype=bool)
    readers, made_a, made_b, many = _read_pairs(a, b, op_partner)
    if len(made_b):
        _, differ = _unseen_same(made_a, made_b)
        found[np.repeat(readers, many)[differ]] = True
    return found


def bits_part(
    a: Trace,
    b: Trace,
    op_partner: np.ndarray,
    value_partner: np.ndarray,
    same_bits: np.ndarray,
) -> np.ndarray:
    """Per op of B: it has a partner, every tensor it reads is the same bits as what the
    partner read in A (``value_partner`` and ``same_bits`` per output of B), and its own
    outputs' digest is not the partner's."""
    paired = op_partner >= 0
    partner = np.maximum(op_partner, 0)
    readers, made_a, made_b, many = _read_pairs(a, b, op_partner)
    same_inputs = np.zeros(len(b), dtype=bool)
    same_inputs[readers[many == 0]] = True
    readers, many = readers[many > 0], many[many > 0]
    if len(readers):
        offsets = np.arange(many.sum()) - np.repeat(np.cumsum(many) - many, many)
        known = (made_b["op"] >= 0) & (made_a["op"] >= 0)
        vb = b.first_value[np.maximum(made_b["op"], 0)] + made_b["output"].astype(np.int64)
        va = a.first_value[np.maximum(made_a["op"], 0)] + made_a["output"].astype(np.int64)
        agree = known & (value_partner[vb] == va) & same_bits[vb]
        agree |= _unseen_same(made_a, made_b)[0]
        # A random fill in place (bernoulli_, normal_, uniform_, ...) writes its first
        # input without reading its values: what was there does not count.
        names, which = np.unique(b.ops["op"][readers], return_inverse=True)
        fills = np.array([_random_fill(b.text(name)) for name in names.tolist()], dtype=bool)
        agree[np.repeat(fills[which.reshape(-1)], many) & (offsets == 0)] = True
        starts = np.concatenate(([0], np.cumsum(many)[:-1]))
        same_inputs[readers] = np.logical_and.reduceat(agree, starts)
    differ = paired & (
        (a.ops["high"][partner] != b.ops["high"]) | (a.ops["low"][partner] != b.ops["low"])
    )
    found: np.ndarray = same_inputs & differ
    for made_by_none in (STATE_OP, READ_OP):  # rows of data no op computed
        if made_by_none in b.strings:
            found &= b.ops["op"] != b.strings.index(made_by_none)
    return found


@functools.lru_cache(maxsize=1024)
def _random_fill(name: str) -> bool:
    """A random op that fills its first argument in place (``aten::normal_``)."""
    return name.partition(".")[0].endswith("_") and random_op(name)


@functools.lru_cache(maxsize=1024)
def random_op(name: str) -> bool:
    """Whether the ATen op named ``name`` (``aten::bernoulli_.float``) draws random numbers
    (torch tags it ``nondeterministic_seeded``); ``False`` for a name this torch lacks."""
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return torch.Tag.nondeterministic_seeded in getattr(packet, overload or "default").tags
    except (AttributeError, RuntimeError):
        return False
