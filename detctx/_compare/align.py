"""Line two traces' ops up: module by module, then ops within a module by name and order.

Ops do not pair one to one across environments: another kernel can be other
ATen ops (SDPA's flash kernel is one op on a CPU, its math kernel a dozen),
a release can add or fuse ops. Each trace is cut into *segments*: runs of
consecutive ops in one module and one pass (forward or backward). The two
sequences of segments are matched by module and pass, then, inside each
matched pair of segments whose ops differ, the ops by name, both with
:func:`match`. Traces with the same ops in the same modules (the usual
case: one program, two machines) take a fast path that pairs op ``i`` with
op ``i``.

:func:`~detctx._compare.matching.match` pairs equal keys of two sequences in order
(:mod:`detctx._compare.matching`), in time linear in their length.

Where a segment's ops do not all pair, the segment is *partial*: its
unpaired ops are compared where their values leave it, through the data
flow (:mod:`detctx._compare.compare`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from detctx._compare.format import Trace
from detctx._compare.matching import EDITS, GAP_CELLS, RUN, Matcher, match, spans

__all__ = [
    "EDITS",
    "FUSED",
    "GAP_CELLS",
    "RUN",
    "Alignment",
    "Matcher",
    "Partial",
    "align",
    "fed_by_fused",
    "match",
]

FUSED: Final = 4
"""A module (in one pass) with more than this many times the ops in one trace as in the other
runs fused kernels on one side: inside it only the ops both end with pair."""


@dataclass(frozen=True)
class Partial:
    """A module (in one pass) whose ops did not all pair."""

    module_path: str
    backward: bool
    ops_a: int
    ops_b: int
    aligned: int


@dataclass(frozen=True)
class Alignment:
    """``partner[i]``: the op of A paired with op ``i`` of B, or -1."""

    partner: np.ndarray
    partial: list[Partial]
    unmatched_modules_a: list[str]
    unmatched_modules_b: list[str]
    fused: list[tuple[int, int, int, int]]
    """Each pair of segments run as a fused kernel on one side and as its parts on the other
    (see :data:`FUSED`): ``(start in A, end in A, start in B, end in B)``."""
    covered: tuple[int, int] = (0, 0)
    """The ops of A and of B paired, or in a module (and pass) whose ops differ between the
    two (another kernel's, a fused kernel's parts): the program both traces record."""

    @property
    def aligned(self) -> int:
        return int((self.partner >= 0).sum())


def _codes(trace: Trace, column: str, table: dict[str, int]) -> np.ndarray:
    """Each op's string in ``column`` as a number both traces share through ``table``."""
    lookup = np.array([table.setdefault(text, len(table)) for text in trace.strings], np.int64)
    return lookup[trace.ops[column].astype(np.int64)] if len(trace) else np.zeros(0, np.int64)


def _keys(trace: Trace, table: dict[str, int]) -> np.ndarray:
    """Each op's module and pass as one number: twice the module's, plus 1 in the backward
    (an op run by an autograd node)."""
    if not len(trace):
        return np.zeros(0, np.int64)
    forward = np.array([text == "" for text in trace.strings], bool)
    backward = (~forward[trace.ops["node"].astype(np.int64)]).astype(np.int64)
    keys: np.ndarray = 2 * _codes(trace, "module", table) + backward
    return keys


def _shaped(trace: Trace, ops: np.ndarray, table: dict[str, int]) -> np.ndarray:
    """Each op's name and its first output's shape as one number, shared through ``table``."""
    if not len(trace.values):
        return ops
    lookup = np.array([table.setdefault(text, len(table)) for text in trace.strings], np.int64)
    first = np.minimum(trace.first_value[:-1], len(trace.values) - 1)
    shapes = np.where(
        trace.ops["outputs"] > 0, lookup[trace.values["shape"][first].astype(np.int64)], -1
    )
    shaped: np.ndarray = ops * (1 << 31) + shapes
    return shaped


def _flowed(
    trace: Trace,
    lo: int,
    hi: int,
    columns: tuple[np.ndarray, np.ndarray],
    mapped: np.ndarray,
    flows: dict[tuple[int, ...], int],
) -> np.ndarray:
    """The ops ``lo..hi`` as keys of their module and pass, name and first output's shape
    (``columns``) and where their inputs come from: for an input made by a paired op
    before them, that op as A numbers it (``mapped``: B's partners, or A's paired ops as
    themselves); else whether it was made by an op without a partner (yet: one of these)
    or by no recorded op. ``flows`` gives each distinct key its number, shared by both
    traces."""
    keys = np.empty(hi - lo, dtype=np.int64)
    producers = trace.inputs["op"]
    module, shaped = columns
    for row, op in enumerate(range(lo, hi)):
        origins = [
            -2 if made < 0 else -1 if lo <= made < hi else int(mapped[made])
            for made in producers[trace.first_input[op] : trace.first_input[op + 1]].tolist()
        ]
        keys[row] = flows.setdefault((int(module[op]), int(shaped[op]), *origins), len(flows))
    return keys


def _segments(keys: np.ndarray) -> np.ndarray:
    """Where each run of equal keys starts, with the end appended."""
    if not len(keys):
        return np.zeros(1, np.int64)
    change = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    return np.concatenate([[0], change, [len(keys)]]).astype(np.int64)


def align(a: Trace, b: Trace) -> Alignment:
    """Pair B's ops with A's."""
    table: dict[str, int] = {}
    ops_a, ops_b = _codes(a, "op", table), _codes(b, "op", table)
    keys_a, keys_b = _keys(a, table), _keys(b, table)
    partner = np.full(len(b), -1, dtype=np.int64)
    if np.array_equal(ops_a, ops_b) and np.array_equal(keys_a, keys_b):
        partner[:] = np.arange(len(b))
        return Alignment(partner, [], [], [], [], (len(a), len(b)))
    starts_a, starts_b = _segments(keys_a), _segments(keys_b)
    segment_a, segment_b = match(keys_a[starts_a[:-1]], keys_b[starts_b[:-1]])
    low_a, size_a = starts_a[segment_a], np.diff(starts_a)[segment_a]
    low_b, size_b = starts_b[segment_b], np.diff(starts_b)[segment_b]
    # Matched segments with the same ops pair op for op, all at once; the others one by one.
    alike = np.flatnonzero(size_a == size_b)
    spans_a, spans_b = spans(low_a[alike], size_a[alike]), spans(low_b[alike], size_b[alike])
    differing = np.zeros(len(alike), bool)
    owner = np.repeat(np.arange(len(alike)), size_a[alike])
    # Ops of one name with other shapes differ too: a lone gradient sum outside every module
    # pairs with the next one of its name, which may be a query's where this is a key's.
    shaped_a, shaped_b = _shaped(a, ops_a, table), _shaped(b, ops_b, table)
    np.logical_or.at(differing, owner, shaped_a[spans_a] != shaped_b[spans_b])
    same = np.zeros(len(segment_a), bool)
    same[alike[~differing]] = True
    paired = ~differing[owner]
    partner[spans_b[paired]] = spans_a[paired]
    # A's paired ops as themselves (-1 for the others): what _flowed maps A's inputs by.
    known_a = np.full(len(a), -1, dtype=np.int64)
    known_a[partner[partner >= 0]] = partner[partner >= 0]
    fused: list[tuple[int, int, int, int]] = []
    runs: list[list[int]] = []
    for pair in np.flatnonzero(~same).tolist():
        lo_a, hi_a = int(low_a[pair]), int(low_a[pair] + size_a[pair])
        lo_b, hi_b = int(low_b[pair]), int(low_b[pair] + size_b[pair])
        if max(hi_a - lo_a, hi_b - lo_b) <= FUSED * min(hi_a - lo_a, hi_b - lo_b):
            if runs and runs[-1][-1] == pair - 1:
                runs[-1].append(pair)
            else:
                runs.append([pair])
            continue
        # A fused kernel against its parts (an LSTM layer's one op against a step per
        # time step, AdamW's fused kernel against its per-parameter ops): ops of the
        # same name inside compute other things; only the ops both end with pair (a
        # step counter), unless two of those share a name and shape (an LSTM's final
        # states, stacked in another order). The module is compared where its values
        # meet paired ops.
        tail_a, tail_b = shaped_a[lo_a:hi_a][::-1], shaped_b[lo_b:hi_b][::-1]
        common = min(len(tail_a), len(tail_b))
        unequal = np.flatnonzero(tail_a[:common] != tail_b[:common])
        ends = int(unequal[0]) if len(unequal) else common
        if len(np.unique(tail_a[:ends])) < ends:
            ends = 0  # two of them share a name and shape: which is which is not known
        partner[hi_b - ends : hi_b] = np.arange(hi_a - ends, hi_a, dtype=np.int64)
        known_a[hi_a - ends : hi_a] = np.arange(hi_a - ends, hi_a, dtype=np.int64)
        fused.append((lo_a, hi_a, lo_b, hi_b))
    # Consecutive segments whose ops differ (another kernel's ops, with gradient sums
    # outside every module between them) are matched as one region, op by op, by module,
    # name, first output's shape and where the inputs come from (_flowed): the math
    # kernel's backward adds ops of the same names, and by name alone a query's op paired
    # with a key's (GQA: [4, 4, 32, 32] against [4, 2, 32, 32]), or a key's gradient times
    # sin with the one times cos, where the backward runs them in another order.
    for run in runs:
        lo_a, hi_a = int(low_a[run[0]]), int(low_a[run[-1]] + size_a[run[-1]])
        lo_b, hi_b = int(low_b[run[0]]), int(low_b[run[-1]] + size_b[run[-1]])
        flows: dict[tuple[int, ...], int] = {}
        inner_a, inner_b = match(
            _flowed(a, lo_a, hi_a, (keys_a, shaped_a), known_a, flows),
            _flowed(b, lo_b, hi_b, (keys_b, shaped_b), partner, flows),
        )
        partner[lo_b + inner_b] = lo_a + inner_a
        known_a[lo_a + inner_a] = lo_a + inner_a
    names = list(table)
    partial = []
    for pair in np.flatnonzero(~same).tolist():
        lo_b, hi_b = int(low_b[pair]), int(low_b[pair] + size_b[pair])
        key = int(keys_b[lo_b])
        partial.append(
            Partial(
                names[key // 2],
                bool(key % 2),
                int(size_a[pair]),
                hi_b - lo_b,
                int((partner[lo_b:hi_b] >= 0).sum()),
            )
        )
    # Modules whose ops differ count whole, wherever their segments lie (an unfused LSTM's
    # backward comes in several, between gradient sums outside any module); ops outside
    # every module count only where paired.
    outside = 2 * table.get("", -1)
    differing = np.array(
        sorted(
            {int(keys_b[low_b[pair]]) for pair in np.flatnonzero(~same)} - {outside, outside + 1}
        ),
        dtype=np.int64,
    )
    paired_a = known_a >= 0
    covered = (
        int((paired_a | np.isin(keys_a, differing)).sum()),
        int(((partner >= 0) | np.isin(keys_b, differing)).sum()),
    )
    return Alignment(
        partner,
        _merge(partial),
        _unmatched(keys_a, starts_a, segment_a, names),
        _unmatched(keys_b, starts_b, segment_b, names),
        fused,
        covered,
    )


def _unmatched(
    keys: np.ndarray, starts: np.ndarray, matched: np.ndarray, names: list[str]
) -> list[str]:
    """The modules of the segments that found no partner, sorted."""
    left = np.ones(len(starts) - 1, bool)
    left[matched] = False
    return sorted({names[int(key) // 2] for key in np.unique(keys[starts[:-1][left]])})


def _merge(partial: list[Partial]) -> list[Partial]:
    """One entry per module and pass, its counts summed over the run's steps and layers'
    repeats of it."""
    merged: dict[tuple[str, bool], Partial] = {}
    for entry in partial:
        key = (entry.module_path, entry.backward)
        known = merged.get(key)
        merged[key] = (
            entry
            if known is None
            else Partial(
                entry.module_path,
                entry.backward,
                known.ops_a + entry.ops_a,
                known.ops_b + entry.ops_b,
                known.aligned + entry.aligned,
            )
        )
    return list(merged.values())


def fed_by_fused(b: Trace, alignment: Alignment) -> dict[int, str]:
    """Per op of B in a module one run computes with a fused kernel and the other with its
    parts (an LSTM layer), or reading values that module's unpaired ops made (directly or
    through other unpaired ops: the gradient sums of an unfused backward): that module.
    A change inside it shows first where its values leave it, at such an op."""
    if not alignment.fused:
        return {}
    source = np.full(len(b), -1, dtype=np.int64)
    for number, (_, _, lo_b, hi_b) in enumerate(alignment.fused):
        source[lo_b:hi_b] = number
    paired = alignment.partner >= 0
    producers = b.inputs["op"]
    found: dict[int, str] = {}
    for op in range(len(b)):
        made = producers[b.first_input[op] : b.first_input[op + 1]]
        made = made[made >= 0]
        fed = source[made[~paired[made]]] if len(made) else source[:0]
        fed = fed[fed >= 0]
        if source[op] < 0 and len(fed) and not paired[op]:
            source[op] = fed[0]  # an unpaired op passes the module on
        module = source[op] if source[op] >= 0 else (fed[0] if len(fed) else -1)
        if module >= 0:
            found[op] = b.text(b.ops["module"][alignment.fused[int(module)][2]])
    return found
