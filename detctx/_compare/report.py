"""``detctx.compare_traces``: two recorded runs (a trace each, or a folder of rank traces)
compared rank by rank, as one :class:`TraceComparison`.

Ranks of one run execute the same program in step, so among the ranks'
origins the one at the lowest op index came first (a tie goes to the lower
rank): a rank whose values changed makes its collectives hand the change to
the others, where it shows later.

**What "agree" means.** Both runs hold the same ranks and ran to their end;
every op of each trace was compared with a partner or is accounted for
through the data flow (:mod:`detctx._compare.compare`); and every compared
output is within tolerance. Anything else is reported and the verdict is
"differ": steps or ops one run has and the other has not (named, with where
they are), a run that raised or was cut short, ranks one run lacks. A folder
whose traces do not form one run (a rank file missing for the world size
its headers state, ranks of two recordings mixed) is refused.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Final

from detctx._basics import TraceError
from detctx._compare.compare import RankComparison, compare_rank
from detctx._compare.environment import environment_differences
from detctx._compare.findings import (
    SHOWN_MODULES,
    BitsPart,
    OpError,
    UnpairedOps,
    bits_parts,
    op_error,
    unpaired_ops,
)
from detctx._compare.format import COMPLETED, READ_OP, STATE_OP, UNSHARED
from detctx._compare.parting import RANDOM_ADVICE
from detctx._compare.reading import read_run

__all__ = ["TraceComparison", "compare_traces"]

MIN_ALIGNED: Final = 0.5
"""Below this share of either trace's ops aligned, the traces record different programs."""


@dataclass
class TraceComparison:
    """Two recorded runs compared within tolerance.

    ``agree``: the same ranks, both runs ran to their end, every op compared or accounted
    for, and every op within tolerance; ``bitwise``: besides, every digest equal;
    ``origin``: the first op whose error its inputs do not explain (``None`` when none is
    past tolerance); ``past_tolerance``: every op past tolerance, each ``kind``
    ``"origin"`` or ``"inherited"`` (``difference`` says what differs besides values:
    shape, number of outputs); ``unpaired``: runs of ops one trace has and the other has
    not, that no paired op reads (``trace`` ``"A"`` or ``"B"``, ``first``..``last``
    their indices, ``at_end`` after the other trace's last paired op);
    ``not_completed``: ``"A"``/``"B"`` -> how a run that did not run to its end ended;
    ``ranks_only``: ``"A"``/``"B"`` -> ranks the other run lacks; ``bits_part``: every op
    whose inputs are the same bits in A and B and whose outputs are not, within
    tolerance or not (the op itself computed something else; a random op's generator drew
    differently);
    ``environment_differences``: ``name -> [value in A, value in B]``.
    """

    a: str
    b: str
    ranks: list[RankComparison] = field(repr=False)
    agree: bool = True
    bitwise: bool = True
    origin: OpError | None = None
    past_tolerance: list[OpError] = field(default_factory=list)
    unpaired: list[UnpairedOps] = field(default_factory=list)
    bits_part: list[BitsPart] = field(default_factory=list)
    not_completed: dict[str, str] = field(default_factory=dict)
    ranks_only: dict[str, list[int]] = field(default_factory=dict)
    environment_differences: dict[str, list[Any]] = field(default_factory=dict)
    partial_alignment: list[dict[str, Any]] = field(default_factory=list)
    modules_only: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Plain data, what ``detctx compare --json`` prints."""
        return {
            "a": self.a,
            "b": self.b,
            "agree": self.agree,
            "bitwise": self.bitwise,
            "origin": self.origin.as_dict() if self.origin else None,
            "past_tolerance": [entry.as_dict() for entry in self.past_tolerance],
            "unpaired": [entry.as_dict() for entry in self.unpaired],
            "bits_part": [entry.as_dict() for entry in self.bits_part],
            "not_completed": self.not_completed,
            "ranks_only": self.ranks_only,
            "environment_differences": self.environment_differences,
            "partial_alignment": self.partial_alignment,
            "modules_only": self.modules_only,
            "ops": [
                {"rank": r.rank, "a": len(r.a), "b": len(r.b), "aligned": r.alignment.aligned}
                for r in self.ranks
            ],
            "notes": self.notes,
        }

    def format(self, shown: int = 10) -> str:
        """The report ``detctx compare`` prints."""
        lines = []
        for rank in self.ranks:
            lines.append(
                f"rank {rank.rank}: {len(rank.a)} ops in A, {len(rank.b)} in B, "
                f"{rank.alignment.aligned} aligned"
            )
        for entry in self.partial_alignment:
            lines.append(
                f"  partly aligned: {entry['module_path'] or '(no module)'} "
                f"({'backward' if entry['backward'] else 'forward'}): {entry['aligned']} of "
                f"{entry['ops_a']} ops in A and {entry['ops_b']} in B pair; compared at its outputs"
            )
        for side, modules in self.modules_only.items():
            lines.append(
                f"  modules whose own ops run in {side} only: "
                + ", ".join(modules[:SHOWN_MODULES])
                + (
                    f" and {len(modules) - SHOWN_MODULES} more"
                    if len(modules) > SHOWN_MODULES
                    else ""
                )
            )
        if self.environment_differences:
            lines.append("environment differences (A -> B):")
            lines += [
                f"  {name}: {values[0]!r} -> {values[1]!r}"
                for name, values in self.environment_differences.items()
            ]
        lines += [f"note: {note}" for note in self.notes]
        if self.bitwise:
            lines.append("traces AGREE bit for bit: every op produced the same bits.")
        elif self.agree:
            lines.append("traces AGREE within tolerance (not bit for bit).")
        else:
            lines.append(f"traces DIFFER: {self._reasons()}.")
        lines += self._what_differs(shown)
        lines += self._where_bits_part()
        return "\n".join(lines)

    def _where_bits_part(self) -> list[str]:
        if self.bitwise or not self.bits_part:
            return []
        first = min(self.bits_part, key=lambda entry: (entry.index, entry.rank))
        line = (
            f"bits first part: rank {first.rank}, op {first.index} {first.op} in "
            f"{first.module_path or '(no module)'} ({first.source}): its inputs are the same "
            f"bits in A and B, its outputs are not (error {_number(first.error)}, tolerance "
            f"{_number(first.tolerance)})"
        )
        if first.random:
            line += f"; {RANDOM_ADVICE}"
        if len(self.bits_part) > 1:
            line += (
                f"; {len(self.bits_part) - 1} more ops where the bits part from the same "
                "inputs (--json lists all)"
            )
        return [line]

    def _reasons(self) -> str:
        reasons = [f"{side}'s run did not run to its end" for side in self.not_completed]
        if self.ranks_only:
            reasons.append("the runs hold other ranks")
        if self.unpaired:
            ops = sum(entry.ops for entry in self.unpaired)
            reasons.append(f"{ops} ops in one trace only")
        if self._states():
            reasons.append("the recordings start from different states")
        if self._unmade():
            reasons.append("parameters or buffers differ where first read")
        if self.past_tolerance:
            reasons.append(f"{len(self.past_tolerance)} ops past tolerance")
        return ", ".join(reasons)

    def _states(self) -> list[str]:
        """The tensors of a window's entering state past tolerance: their names."""
        return [past.source.strip("[]") for past in self.past_tolerance if past.op == STATE_OP]

    def _unmade(self) -> list[str]:
        """The parameters and buffers past tolerance where first read: their names."""
        return [past.source.strip("[]") for past in self.past_tolerance if past.op == READ_OP]

    def _what_differs(self, shown: int) -> list[str]:
        lines = []
        for side, outcome in self.not_completed.items():
            lines.append(f"{side}'s run did not run to its end: {outcome}")
        for side, ranks in self.ranks_only.items():
            lines.append(f"ranks only {side} has, not compared: {ranks}")
        for entry in self.unpaired[:shown]:
            where = (
                f"at the end of {entry.trace} (the other run stops before them: fewer "
                "steps, or cut short)"
                if entry.at_end
                else "that no paired op reads"
            )
            lines.append(
                f"only in {entry.trace}: rank {entry.rank} ops {entry.first}.."
                f"{entry.last} ({entry.ops} ops, from {entry.op} at "
                f"{entry.source}) in {', '.join(entry.modules)}, {where}"
            )
        if len(self.unpaired) > shown:
            lines.append(f"  ... {len(self.unpaired) - shown} more runs of ops (--json lists all)")
        if not self.past_tolerance:
            return lines
        states = self._states()
        if states:
            named = ", ".join(states[:shown]) + (
                f" and {len(states) - shown} more" if len(states) > shown else ""
            )
            lines.append(
                f"the recordings started from different states: {len(states)} tensors of the "
                f"state the window starts from differ ({named}); record both from one "
                "checkpoint (resume both, then record a window) to compare the steps"
            )
        unmade = self._unmade()
        if unmade:
            named = ", ".join(dict.fromkeys(unmade[:shown])) + (
                f" and {len(unmade) - shown} more" if len(unmade) > shown else ""
            )
            lines.append(
                f"parameters or buffers differ where the program first reads them: "
                f"{len(unmade)} tensors ({named}): set before the recording or by code not "
                "recorded (initialised, changed or loaded otherwise)"
            )
        origin = self.origin
        if origin is None:
            lines.append(
                "no origin: every op past tolerance inherited its error from its inputs "
                "(the error grew op by op, as rounding noise does, rather than entering at "
                "one op)"
            )
        else:
            lines.append(
                f"origin: rank {origin.rank}, op {origin.index} {origin.op} in "
                f"{origin.module_path or '(no module)'} ({origin.source}): error "
                f"{_number(origin.error)}, tolerance {_number(origin.tolerance)}; "
                f"its inputs' largest error {_number(origin.input_error)}"
                + (f"; {origin.dtypes[0]} in A, {origin.dtypes[1]} in B" if origin.dtypes else "")
                + (f"; {origin.difference}" if origin.difference else "")
            )
            if origin.inside is not None:
                lines.append(
                    f"  the change may be inside {origin.inside or '(no module)'}: one run "
                    "computes it with a fused kernel, the other with its parts, so it is "
                    "compared where its values leave it, here"
                )
        for past in self.past_tolerance[:shown]:
            lines.append(
                f"  {past.kind:9} rank {past.rank} op {past.index} {past.op} "
                f"{past.module_path or '(no module)'} {past.source} error "
                f"{_number(past.error)}" + (f" ({past.difference})" if past.difference else "")
            )
        if len(self.past_tolerance) > shown:
            lines.append(f"  ... {len(self.past_tolerance) - shown} more (--json lists all)")
        return lines


def _number(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def compare_traces(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    rtol: float | None = None,
    atol: float | None = None,
) -> TraceComparison:
    """Compare two recorded runs (trace files, or folders of rank traces) within tolerance.

    ``rtol``/``atol`` replace every float dtype's defaults. Raises
    :class:`~detctx.TraceError` when they cannot be compared: a file that is not a whole
    trace, a folder that is not all the ranks of one run, traces of different programs.
    """
    for value, name in ((rtol, "rtol"), (atol, "atol")):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
    run_a, run_b = read_run(a), read_run(b)
    result = TraceComparison(str(a), str(b), [])
    for side, run in (("A", run_a), ("B", run_b)):
        only = sorted(set(run) - set(run_a if side == "B" else run_b))
        if only:
            result.ranks_only[side] = only
        for trace in run.values():
            if trace.outcome != COMPLETED:
                ended = f"rank {trace.header['rank']} {trace.outcome}"
                result.not_completed.setdefault(side, ended)
        worlds = {trace.header["world_size"] for trace in run.values()}
        if len(run) == 1 and max(worlds) > 1:
            (rank,) = run
            result.notes.append(
                f"{side} is rank {rank} of a run of {max(worlds)} ranks: that rank alone is "
                "compared"
            )
        if len(run) > 1 and any(trace.header["run"] == UNSHARED for trace in run.values()):
            result.notes.append(
                f"{side}'s traces carry no shared run identity (recorded without detctx "
                "record, a process group or a torchrun run id): that they are one run's ranks "
                "was not checked"
            )
    common = sorted(set(run_a) & set(run_b))
    if not common:
        raise TraceError(f"{a} and {b} have no rank in common")
    for rank in common:
        empty = [trace.path for trace in (run_a[rank], run_b[rank]) if not len(trace)]
        if empty:
            raise TraceError(
                f"{' and '.join(map(str, empty))} {'hold' if len(empty) > 1 else 'holds'} no "
                "op: the process recorded ran no torch op, so there is nothing to compare"
            )
        compared = compare_rank(rank, run_a[rank], run_b[rank], rtol, atol)
        # Ops of one module that differ (a fused kernel against its parts: an LSTM with
        # oneDNN and without) count as the same program; they are compared where their
        # values meet paired ops (the module's outputs, its parameters' gradients).
        covered_a, covered_b = compared.alignment.covered
        if covered_a < MIN_ALIGNED * len(compared.a) or covered_b < MIN_ALIGNED * len(compared.b):
            raise TraceError(
                f"{run_a[rank].path} and {run_b[rank].path} record different programs: only "
                f"{covered_a} of {len(compared.a)} ops of A and {covered_b} of "
                f"{len(compared.b)} of B are in modules both record"
            )
        result.ranks.append(compared)
        differences = environment_differences(run_a[rank].environment, run_b[rank].environment)
        for name, values in differences.items():
            result.environment_differences.setdefault(name, values)
        result.partial_alignment += [
            {"rank": rank, **vars(entry)} for entry in compared.alignment.partial
        ]
        for side, modules in (
            ("A", compared.alignment.unmatched_modules_a),
            ("B", compared.alignment.unmatched_modules_b),
        ):
            known = result.modules_only.setdefault(side, [])
            known += [module or "(no module)" for module in modules if module not in known]
        result.unpaired += unpaired_ops(compared)
        result.bits_part += bits_parts(compared)
    result.modules_only = {side: found for side, found in result.modules_only.items() if found}
    for compared in result.ranks:
        result.past_tolerance += [op_error(compared, int(i)) for i in compared.past.nonzero()[0]]
    result.agree = not (
        result.past_tolerance or result.unpaired or result.not_completed or result.ranks_only
    )
    result.bitwise = result.agree and all(r.bitwise for r in result.ranks)
    origins = [entry for entry in result.past_tolerance if entry.kind == "origin"]
    if origins:
        result.origin = min(origins, key=lambda entry: (entry.index, entry.rank))
    return result
