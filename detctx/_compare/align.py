"""Line two traces' ops up: module by module, then ops within a module by name and order.

Ops do not pair one to one across environments: another kernel can be other
ATen ops (SDPA's flash kernel is one op on a CPU, its math kernel a dozen),
a release can add or fuse ops. Each trace is cut into *segments*: runs of
consecutive ops in one module and one pass (forward or backward). The two
sequences of segments are matched by module and pass (longest common
subsequence, :class:`difflib.SequenceMatcher`), then, inside each matched
pair of segments, the ops by name in order the same way. Traces with the
same ops in the same modules (the usual case: one program, two machines)
take a fast path that pairs op ``i`` with op ``i``.

Where a segment's ops do not all pair, the segment is *partial*: its
unpaired ops are compared where their values leave it, through the data
flow (:mod:`detctx._compare.compare`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import numpy as np

from detctx._compare.format import Trace

__all__ = ["Alignment", "Partial", "align"]


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

    @property
    def aligned(self) -> int:
        return int((self.partner >= 0).sum())


def _names(trace: Trace, column: str) -> list[str]:
    table = np.array(trace.strings, dtype=object) if trace.strings else np.zeros(0, object)
    return list(table[trace.ops[column]]) if len(trace.ops) else []


def _segments(
    modules: list[str], backward: np.ndarray
) -> tuple[list[tuple[str, bool]], np.ndarray]:
    """The segments' keys, and where each starts (with the end appended)."""
    count = len(modules)
    if not count:
        return [], np.zeros(1, dtype=np.int64)
    module_ids = np.unique(np.array(modules, dtype=object), return_inverse=True)[1]
    change = np.flatnonzero((np.diff(module_ids) != 0) | (np.diff(backward) != 0)) + 1
    starts = np.concatenate([[0], change, [count]]).astype(np.int64)
    keys = [(modules[start], bool(backward[start])) for start in starts[:-1]]
    return keys, starts


def align(a: Trace, b: Trace) -> Alignment:
    """Pair B's ops with A's."""
    names_a, names_b = _names(a, "op"), _names(b, "op")
    modules_a, modules_b = _names(a, "module"), _names(b, "module")
    backward_a = a.ops["node"] != a.strings.index("") if "" in a.strings else np.zeros(len(a), bool)
    backward_b = b.ops["node"] != b.strings.index("") if "" in b.strings else np.zeros(len(b), bool)
    partner = np.full(len(b), -1, dtype=np.int64)
    if names_a == names_b and modules_a == modules_b:
        partner[:] = np.arange(len(b))
        return Alignment(partner, [], [], [])
    keys_a, starts_a = _segments(modules_a, backward_a)
    keys_b, starts_b = _segments(modules_b, backward_b)
    partial: list[Partial] = []
    seen_a, seen_b = set(), set()
    matcher = difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False)
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            sa, sb = block.a + offset, block.b + offset
            seen_a.add(sa)
            seen_b.add(sb)
            lo_a, hi_a = int(starts_a[sa]), int(starts_a[sa + 1])
            lo_b, hi_b = int(starts_b[sb]), int(starts_b[sb + 1])
            ops_a, ops_b = names_a[lo_a:hi_a], names_b[lo_b:hi_b]
            if ops_a == ops_b:
                partner[lo_b:hi_b] = np.arange(lo_a, hi_a)
                continue
            inner = difflib.SequenceMatcher(None, ops_a, ops_b, autojunk=False)
            aligned = 0
            for op_block in inner.get_matching_blocks():
                start = lo_b + op_block.b
                partner[start : start + op_block.size] = np.arange(
                    lo_a + op_block.a, lo_a + op_block.a + op_block.size
                )
                aligned += op_block.size
            module, backward = keys_b[sb]
            partial.append(Partial(module, backward, hi_a - lo_a, hi_b - lo_b, aligned))
    missing_a = sorted({keys_a[i][0] for i in range(len(keys_a)) if i not in seen_a})
    missing_b = sorted({keys_b[i][0] for i in range(len(keys_b)) if i not in seen_b})
    return Alignment(partner, _merge(partial), missing_a, missing_b)


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
