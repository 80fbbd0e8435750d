"""The first op where two runs part, and how to describe it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import zip_longest
from pathlib import Path
from typing import NamedTuple

import torch

from detctx._basics import CAUSES_OF_A_DIFFERENT_START
from detctx._locate.batch import (
    COMPARED as _COMPARED,
)
from detctx._locate.batch import (
    ROW,
    Batch,
    RowReader,
    first_difference,
    row_record,
)
from detctx._locate.trace import OpRecord, read_trace

__all__ = [
    "Capture",
    "Divergence",
    "ElementDifference",
    "OpComparison",
    "compare_records",
    "compare_traces",
    "element_difference",
]


@dataclass(frozen=True)
class Divergence:
    """Where run ``run`` first parted from run 1, and how.

    ``index`` is the op's position in the run (0-based, counting recorded
    ops), ``op`` its ATen name (``aten::addmm``), ``module_path`` the
    innermost ``nn.Module`` running (``""`` at top level), ``source`` the
    user's ``file:line`` that issued it (for a backward op, the line of the
    forward op it differentiates), ``node`` the autograd node for a backward
    op (``""`` in the forward pass). ``shape``, ``dtype`` and ``device``
    describe its first output, or, once the differing elements are counted,
    the output they were counted in: ``output`` (0-based) of the op's
    ``outputs`` (a ``_foreach_`` op has one per tensor). ``reason`` is
    ``"values"`` (same op, different bits), ``"rng"`` (a random op whose
    generator state already differed), ``"op"`` (the runs ran different ops
    here), ``"ended"`` (one run ran out of ops) or ``"result"`` (every
    recorded op agreed but the function's results differ: ``path`` names the
    first differing part, ``result[0]``, ``reference`` says what it is,
    ``index`` is the number of ops recorded and ``source`` the line where
    the function is defined; ``shape``, ``dtype`` and ``device`` are those of
    that part when it is a tensor, else empty). ``mismatched``, ``total`` and
    ``max_abs_diff`` are filled in for ``"values"`` when the tensors are at
    hand: run ``run``'s are kept as it runs, run 1's come from a replay that
    agreed with run 1 on every op before this one (when run 1 itself read OS
    entropy, the replay's values stand in for it).
    ``str()`` is a one-paragraph report.
    """

    index: int
    op: str
    module_path: str
    source: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    reason: str
    run: int = 2
    node: str = ""
    reference: str = ""
    mismatched: int | None = None
    total: int | None = None
    max_abs_diff: float | None = None
    first_draw: bool = False
    output: int = 0
    outputs: int = 1
    path: str = ""

    def where(self) -> str:
        module = f"in module {self.module_path}" if self.module_path else "at top level"
        phase = f", in the backward pass ({self.node})" if self.node else ""
        return f"{self.op} {module} ({self.source}){phase}"

    def __str__(self) -> str:
        head = f"Run {self.run} parted from run 1 at op {self.index}"
        output = f"{self.dtype} output of shape {self.shape} on {self.device}"
        if self.outputs > 1:
            output = (
                f"{self.dtype} output {self.output + 1} of {self.outputs}, of shape "
                f"{self.shape}, on {self.device}"
            )
        if self.reason == "rng" and self.first_draw:
            causes = "; ".join(
                f"({number}) {cause}" for number, cause in enumerate(CAUSES_OF_A_DIFFERENT_START, 1)
            )
            return (
                f"{head}, {self.where()}: the RNG stream differed before this op, the first "
                f"random op of the run, so the runs did not start from the same RNG state "
                f"(on {self.device}). Likely causes, the most common first: {causes}."
            )
        if self.reason == "rng":
            return (
                f"{head}, {self.where()}: the RNG stream differed before this op. Every "
                "recorded op before it produced the same bits, but the generator it draws "
                f"from (on {self.device}) was in another state: something drew from it outside "
                "the recorded ops (another thread, a C extension) or reseeded it, so its "
                "random numbers differ."
            )
        if self.reason == "op":
            return (
                f"{head}: run {self.run} ran {self.where()} where run 1 ran {self.reference}. "
                "The runs took different paths here (control flow that depends on data, a "
                "counter, the clock or the environment)."
            )
        if self.reason == "result":
            ops = f"all {self.index} recorded ops produced the same bits in both runs"
            if self.index < 2:
                ops = "the one recorded op agreed" if self.index else "no op computing was recorded"
            return (
                f"Run {self.run} returned another result than run 1 at {self.path} "
                f"({self.reference}), though {ops} (the function: {self.source}). The "
                "difference came from "
                "outside torch ops: data from NumPy, Python, a file or OS entropy that reached "
                "the result without an op computing from it (only copied, viewed or filled "
                "in, which is not recorded), or a value the function returned without torch."
            )
        if self.reason == "ended":
            return (
                f"{head}: {self.reference}. The runs agree up to there but one ran more ops "
                f"(the next: {self.where()})."
            )
        if self.mismatched is not None and self.total is not None:
            gap = (
                ""
                if self.max_abs_diff is None
                else (f", largest absolute difference {self.max_abs_diff:.6g}")
            )
            detail = f": {self.mismatched} of {self.total} elements differ{gap}"
        else:
            detail = " (its tensors were not at hand to count the differing elements)"
        return (
            f"{head}, {self.where()}: its {output} differs{detail}. Every recorded op "
            "before it produced the same bits in both runs, so the difference entered here: "
            "look at what this op reads that no earlier op made (data from outside torch, "
            "OS entropy, a tensor from before the run) or at a nondeterministic kernel."
        )


_FIELDS = {name: position for position, name in enumerate(ROW.names or ())}


def _describe(record: OpRecord) -> str:
    module = f"in module {record.module_path}" if record.module_path else "at top level"
    return f"{record.op} {module} ({record.source})"


def compare_records(
    index: int, reference: OpRecord | None, record: OpRecord | None, run: int
) -> Divergence | None:
    """The divergence at position ``index`` (``None`` for a run that has ended), if any."""
    if reference is None and record is None:
        return None
    if reference is None or record is None:
        shown = record if record is not None else reference
        assert shown is not None
        ended = f"run {'1' if reference is None else run} ended after {index} ops"
        return _divergence(index, shown, "ended", run, ended)
    if reference.op != record.op:
        return _divergence(index, record, "op", run, _describe(reference))
    if reference.rng != record.rng:
        return _divergence(index, record, "rng", run)
    # dtype, shape and device: compared as fields, not as the text a trace stores.
    if reference.digest != record.digest or reference[4:7] != record[4:7]:
        return _divergence(index, record, "values", run)
    return None


def _first_draw(found: Divergence | None, drawn: bool) -> Divergence | None:
    """``found``, marked when it is a random op's divergence and no op before it drew."""
    if found is None or found.reason != "rng" or drawn:
        return found
    return replace(found, first_draw=True)


def _divergence(
    index: int, record: OpRecord, reason: str, run: int, reference: str = ""
) -> Divergence:
    return Divergence(
        index,
        record.op,
        record.module_path,
        record.source,
        record.shape,
        record.dtype,
        record.device,
        reason,
        run,
        record.node,
        reference,
    )


class OpComparison:
    """A sink that compares a run, batch by batch, with a reference run's rows."""

    def __init__(self, reference: RowReader, run: int) -> None:
        self.reference = reference
        self.run = run
        self.found: Divergence | None = None
        self.reference_record: OpRecord | None = None
        self.tensors: list[torch.Tensor] = []
        self.drawn = False  # whether an op before the compared ones drew random numbers
        self.index = 0  # ops compared

    def wants(self, index: int, row: tuple[int, ...]) -> bool:
        """Whether op ``index`` differs from the reference's (its tensors are then kept)."""
        if self.found is not None:
            return False
        expected = self.reference.peek(index)
        if expected is None:
            return False
        return any(int(expected[name]) != row[_FIELDS[name]] for name in _COMPARED)

    def add_batch(self, batch: Batch) -> None:
        if self.found is not None:
            return
        reference = self.reference.take(len(batch))
        common = len(reference)
        position = first_difference(batch.rows[:common], reference)
        if position is None and common < len(batch):
            position = common
        if position is None:
            self.drawn = self.drawn or bool(reference["random"].any())
            self.index += len(batch)
            return
        drawn = self.drawn or bool(reference["random"][:position].any())
        expected = row_record(reference[position]) if position < common else None
        index = batch.first + position
        found = compare_records(index, expected, batch.record(position), self.run)
        self.found = _first_draw(found, drawn)
        self.reference_record = expected
        self.index = index
        if self.found is not None and self.found.reason == "values":
            self.tensors = batch.tensors(position) or []

    def finish(self) -> Divergence | None:
        """The divergence found, including a reference that ran more ops than this run."""
        if self.found is None:
            rest = self.reference.take(1)
            if len(rest):
                self.found = compare_records(self.index, row_record(rest[0]), None, self.run)
        return self.found


class Capture:
    """A sink that copies the outputs of op number ``index`` of a replay of run 1.

    The copy is kept only if every op before it agreed with run 1's rows
    (``reference``), so it is what run 1's op made from the same inputs.
    """

    def __init__(self, index: int, reference: RowReader) -> None:
        self.index = index
        self.reference = reference
        self.agreed = True
        self.tensors: list[torch.Tensor] = []

    def wants(self, index: int, row: tuple[int, ...]) -> bool:
        return index == self.index

    def add_batch(self, batch: Batch) -> None:
        if not self.agreed or batch.first > self.index:
            return
        before = min(len(batch), self.index - batch.first)
        reference = self.reference.take(before)
        if len(reference) < before or first_difference(batch.rows[:before], reference) is not None:
            self.agreed = False
            return
        if before < len(batch):
            self.tensors = batch.tensors(before) or []


class ElementDifference(NamedTuple):
    """How the first pair of outputs whose bits differ differs: which output (of how many),
    its dtype and shape, and its elements."""

    output: int
    outputs: int
    dtype: str
    shape: tuple[int, ...]
    mismatched: int
    total: int
    max_abs_diff: float | None


def element_difference(
    first: list[torch.Tensor], second: list[torch.Tensor]
) -> ElementDifference | None:
    """The first output pair whose bits differ, and how (``None`` if none does)."""
    for position, (a, b) in enumerate(zip(first, second)):
        if a.dtype != b.dtype or a.shape != b.shape:
            continue
        size = a.element_size()
        word = {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(size, torch.int64)
        bits_a = a.detach().reshape(-1).view(word).reshape(a.numel(), -1)
        bits_b = b.detach().reshape(-1).view(word).reshape(b.numel(), -1)
        differs = (bits_a != bits_b).any(dim=1)
        mismatched = int(differs.sum().item())
        if mismatched == 0:
            continue
        largest: float | None = None
        if a.dtype != torch.bool:
            wide = torch.complex128 if a.is_complex() else torch.float64
            gaps = (a.reshape(-1)[differs].to(wide) - b.reshape(-1)[differs].to(wide)).abs()
            largest = float(gaps.max().item())
            largest = math.nan if math.isnan(largest) else largest
        dtype = str(a.dtype).removeprefix("torch.")
        return ElementDifference(
            position, len(first), dtype, tuple(a.shape), mismatched, a.numel(), largest
        )
    return None


def compare_traces(reference: Path, other: Path, run: int) -> Divergence | None:
    """The first op where the trace ``other`` (of run ``run``) parts from ``reference``.

    Both files are streamed, a record at a time, and checked as they are read.
    """
    first, second = read_trace(reference), read_trace(other)
    drawn = False
    try:
        for index, (a, b) in enumerate(zip_longest(first, second)):
            found = _first_draw(compare_records(index, a, b, run), drawn)
            if found is not None:
                return found
            drawn = drawn or (a is not None and a.rng is not None)
    finally:
        first.close()
        second.close()
    return None
