"""What a trace comparison found, as typed objects: an op past tolerance (:class:`OpError`),
a run of ops one trace has and the other has not (:class:`UnpairedOps`), and an op where
the bits part (:class:`BitsPart`).

Each has ``as_dict()``, the plain data ``detctx compare --json`` prints (infinite and NaN
numbers as text).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

import numpy as np

from detctx._compare.compare import RankComparison
from detctx._compare.parting import random_op

__all__ = ["BitsPart", "OpError", "UnpairedOps", "bits_parts", "op_error", "unpaired_ops"]

SHOWN_MODULES: Final = 5
"""Modules named for a run of unpaired ops, at most."""


@dataclass(frozen=True)
class _AtOp:
    """An op of B: where it ran, its estimated error and the tolerance it was held to."""

    rank: int
    index: int
    op: str
    module_path: str
    source: str
    backward: str | None
    error: float
    tolerance: float

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name, value in data.items():
            if isinstance(value, float):
                data[name] = _finite(value)
        return data


@dataclass(frozen=True)
class OpError(_AtOp):
    """An op of B past tolerance.

    ``kind``: ``"origin"`` (its inputs do not explain its error) or ``"inherited"``;
    ``error`` and ``tolerance``: relative (``inf`` where a shape, a number of outputs, an
    integer's bits or a NaN count differs, which ``difference`` then says);
    ``input_error``: the largest error of the values it reads; ``dtypes``: its dtypes in
    A and in B where an output it was compared at has another in each;
    ``compared_at_outputs``: the op had no partner and was compared where a paired op
    reads its value; ``inside``: the module one run computes with a fused kernel and
    the other with its parts, which the op is in or whose values it reads: a change
    inside that module shows first here, where its values leave it.
    """

    input_error: float
    kind: Literal["origin", "inherited"]
    compared_at_outputs: bool
    dtypes: tuple[str, str] | None
    difference: str | None
    inside: str | None = None

    def as_dict(self) -> dict[str, Any]:
        data = super().as_dict()
        data["dtypes"] = list(self.dtypes) if self.dtypes else None
        return data


@dataclass(frozen=True)
class UnpairedOps:
    """Consecutive ops of one trace (``"A"`` or ``"B"``) that have no partner in the other
    and whose values no paired op reads: ops ``first`` to ``last``, the first one's name
    and source line, the modules they ran in; ``at_end``: after the other trace's last
    paired op (more steps, or the other run cut short)."""

    rank: int
    trace: Literal["A", "B"]
    first: int
    last: int
    ops: int
    op: str
    source: str
    modules: tuple[str, ...]
    at_end: bool

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["modules"] = list(self.modules)
        return data


@dataclass(frozen=True)
class BitsPart(_AtOp):
    """An op of B whose inputs are the same bits as in A and whose outputs are not: the op
    itself computed something else, whatever the size (``error`` within ``tolerance`` or
    not). ``random``: it draws random numbers (its generator draws differently)."""

    random: bool


def bits_parts(rank: RankComparison) -> list[BitsPart]:
    """Every op of ``rank``'s B where the bits part with the same inputs, in order."""
    trace = rank.b
    found = []
    for index in np.flatnonzero(rank.parted).tolist():
        row = trace.ops[index]
        name = trace.text(row["op"])
        found.append(
            BitsPart(
                rank=rank.rank,
                index=index,
                op=name,
                module_path=trace.text(row["module"]),
                source=trace.text(row["source"]),
                backward=trace.text(row["node"]) or None,
                error=float(rank.error[index]),
                tolerance=float(rank.tolerance[index]),
                random=random_op(name),
            )
        )
    return found


def op_error(rank: RankComparison, index: int) -> OpError:
    """Op ``index`` of ``rank``'s B, past tolerance."""
    trace = rank.b
    row = trace.ops[index]
    return OpError(
        rank=rank.rank,
        index=index,
        op=trace.text(row["op"]),
        module_path=trace.text(row["module"]),
        source=trace.text(row["source"]),
        backward=trace.text(row["node"]) or None,
        error=float(rank.error[index]),
        tolerance=float(rank.tolerance[index]),
        input_error=float(rank.input_error[index]),
        kind="origin" if rank.origin[index] else "inherited",
        compared_at_outputs=bool(rank.at_outputs[index]),
        dtypes=rank.retyped.get(index),
        difference=rank.differences.get(index),
        inside=rank.inside.get(index),
    )


def unpaired_ops(rank: RankComparison) -> list[UnpairedOps]:
    """Runs of consecutive unaccounted ops, in A and in B, with where they are."""
    found = []
    sides: tuple[tuple[Literal["A", "B"], Any, np.ndarray, np.ndarray], ...] = (
        ("A", rank.a, rank.unaccounted_a, rank.alignment.partner[rank.alignment.partner >= 0]),
        ("B", rank.b, rank.unaccounted_b, np.flatnonzero(rank.alignment.partner >= 0)),
    )
    for side, trace, lonely, paired_here in sides:
        indices = np.flatnonzero(lonely)
        if not len(indices):
            continue
        last_paired = int(paired_here.max()) if len(paired_here) else -1
        for run in np.split(indices, np.flatnonzero(np.diff(indices) != 1) + 1):
            first, last = int(run[0]), int(run[-1])
            modules = dict.fromkeys(
                trace.text(module) or "(no module)" for module in trace.ops["module"][run].tolist()
            )
            found.append(
                UnpairedOps(
                    rank=rank.rank,
                    trace=side,
                    first=first,
                    last=last,
                    ops=len(run),
                    op=trace.text(trace.ops["op"][first]),
                    source=trace.text(trace.ops["source"][first]),
                    modules=tuple(modules)[:SHOWN_MODULES],
                    at_end=first > last_paired,
                )
            )
    return found


def _finite(value: float) -> float | str:
    """A number for JSON: ``inf`` and ``nan`` (a NaN count that differs) as text."""
    return value if math.isfinite(value) else str(value)
