"""``detctx.compare_traces``: two recorded runs (a trace each, or a folder of rank traces)
compared rank by rank, as one :class:`TraceComparison`.

Ranks of one run execute the same program in step, so among the ranks'
origins the one at the lowest op index came first (a tie goes to the lower
rank): a rank whose values changed makes its collectives hand the change to
the others, where it shows later.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from detctx._basics import TraceError
from detctx._compare.compare import RankComparison, compare_rank
from detctx._compare.environment import environment_differences
from detctx._compare.format import Trace, read_trace

__all__ = ["TraceComparison", "compare_traces", "read_run"]

_RANK_FILE: Final = re.compile(r"rank(0|[1-9][0-9]{0,5})\.trace")
MIN_ALIGNED: Final = 0.5
"""Below this share of either trace's ops aligned, the traces record different programs."""


def read_run(path: str | os.PathLike[str]) -> dict[int, Trace]:
    """A run's traces by rank: one file, or a folder of ``rank<N>.trace`` files."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path} does not exist: give a trace file or a folder of rank traces")
    if not path.is_dir():
        trace = read_trace(path)
        return {int(trace.header["rank"]): trace}
    traces: dict[int, Trace] = {}
    for child in sorted(path.iterdir()):
        match = _RANK_FILE.fullmatch(child.name)
        if match is None:
            continue
        trace = read_trace(child)
        if trace.header["rank"] != int(match.group(1)):
            raise TraceError(f"trace {child} holds rank {trace.header['rank']}'s ops")
        traces[int(match.group(1))] = trace
    if not traces:
        raise TraceError(f"{path} holds no rank<N>.trace files")
    return traces


def _entry(rank: RankComparison, index: int) -> dict[str, Any]:
    trace = rank.b
    row = trace.ops[index]
    error, tolerance = float(rank.error[index]), float(rank.tolerance[index])
    return {
        "rank": rank.rank,
        "index": index,
        "op": trace.text(row["op"]),
        "module_path": trace.text(row["module"]),
        "source": trace.text(row["source"]),
        "backward": trace.text(row["node"]) or None,
        "error": _finite(error),
        "tolerance": _finite(tolerance),
        "input_error": _finite(float(rank.input_error[index])),
        "kind": "origin" if rank.origin[index] else "inherited",
        "compared_at_outputs": bool(rank.at_outputs[index]),
        "dtypes": list(rank.retyped[index]) if index in rank.retyped else None,
    }


def _finite(value: float) -> float | str:
    """A number for JSON: ``inf`` and ``nan`` (a NaN count that differs) as text."""
    return value if math.isfinite(value) else str(value)


@dataclass
class TraceComparison:
    """Two recorded runs compared within tolerance.

    ``agree``: every op within tolerance; ``bitwise``: every digest equal;
    ``origin``: the first op whose error its inputs do not explain (``None`` when
    none is past tolerance); ``past_tolerance``: every op past tolerance, each
    ``kind`` ``"origin"`` or ``"inherited"``; ``environment_differences``:
    ``name -> [value in A, value in B]``.
    """

    a: str
    b: str
    ranks: list[RankComparison] = field(repr=False)
    agree: bool = True
    bitwise: bool = True
    origin: dict[str, Any] | None = None
    past_tolerance: list[dict[str, Any]] = field(default_factory=list)
    environment_differences: dict[str, list[Any]] = field(default_factory=dict)
    partial_alignment: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Plain data, what ``detctx compare --json`` prints."""
        return {
            "a": self.a,
            "b": self.b,
            "agree": self.agree,
            "bitwise": self.bitwise,
            "origin": self.origin,
            "past_tolerance": self.past_tolerance,
            "environment_differences": self.environment_differences,
            "partial_alignment": self.partial_alignment,
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
            origin = self.origin
            lines.append(f"traces DIFFER: {len(self.past_tolerance)} ops past tolerance.")
            if origin is None:
                lines.append(
                    "no origin: every op past tolerance inherited its error from its inputs "
                    "(the error grew op by op, as rounding noise does, rather than entering at "
                    "one op)"
                )
            else:
                lines.append(
                    f"origin: rank {origin['rank']}, op {origin['index']} {origin['op']} in "
                    f"{origin['module_path'] or '(no module)'} ({origin['source']}): error "
                    f"{_number(origin['error'])}, tolerance {_number(origin['tolerance'])}; "
                    f"its inputs' largest error {_number(origin['input_error'])}"
                    + (
                        f"; {origin['dtypes'][0]} in A, {origin['dtypes'][1]} in B"
                        if origin["dtypes"]
                        else ""
                    )
                )
            for entry in self.past_tolerance[:shown]:
                lines.append(
                    f"  {entry['kind']:9} rank {entry['rank']} op {entry['index']} {entry['op']} "
                    f"{entry['module_path'] or '(no module)'} {entry['source']} error "
                    f"{_number(entry['error'])}"
                )
            if len(self.past_tolerance) > shown:
                lines.append(f"  ... {len(self.past_tolerance) - shown} more (--json lists all)")
        return "\n".join(lines)


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
    trace, or traces of different programs.
    """
    for value, name in ((rtol, "rtol"), (atol, "atol")):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
    run_a, run_b = read_run(a), read_run(b)
    result = TraceComparison(str(a), str(b), [])
    if set(run_a) != set(run_b):
        result.notes.append(
            f"A has ranks {sorted(run_a)}, B has {sorted(run_b)}: the ranks both have are compared"
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
        aligned = compared.alignment.aligned
        if aligned < MIN_ALIGNED * max(len(compared.a), len(compared.b), 1):
            raise TraceError(
                f"{run_a[rank].path} and {run_b[rank].path} record different programs: only "
                f"{aligned} of {len(compared.a)} and {len(compared.b)} ops align by module and "
                "name"
            )
        result.ranks.append(compared)
        differences = environment_differences(run_a[rank].environment, run_b[rank].environment)
        for name, values in differences.items():
            result.environment_differences.setdefault(name, values)
        result.partial_alignment += [
            {"rank": rank, **vars(entry)} for entry in compared.alignment.partial
        ]
    result.bitwise = all(r.bitwise for r in result.ranks) and set(run_a) == set(run_b)
    for compared in result.ranks:
        result.past_tolerance += [_entry(compared, int(i)) for i in compared.past.nonzero()[0]]
    result.agree = not result.past_tolerance
    origins = [entry for entry in result.past_tolerance if entry["kind"] == "origin"]
    if origins:
        result.origin = min(origins, key=lambda entry: (entry["index"], entry["rank"]))
    return result
