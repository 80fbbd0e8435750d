"""What the planting harness (``benchmarks/s14_plantings.py``) found, and its tables: per
planting an :class:`Outcome`, per noise-only pair a :class:`Pair`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from benchmarks.harness import Table
from benchmarks.planting import Plan

__all__ = [
    "CLEAR",
    "RTOL",
    "Outcome",
    "Pair",
    "count",
    "missed_table",
    "pair_table",
    "planting_table",
    "share",
]

RTOL: Final = 3e-4  # float32's, TOLERANCES["float32"][0]
CLEAR: Final = 3.0  # a planting at least this many tolerances is "clear"


@dataclass
class Outcome:
    """What the compare of A and a planted B said, and what the planting was."""

    plan: Plan
    own_error: float  # relative L2 at the planted op (module changes: estimated)
    made: bool  # the bits first part at the planted op (or in the planted module)
    expected: int  # B's op index where the change is made (module changes: first parted)
    inputs_same: bool  # the op's inputs have A's bits (the compare's input error is 0)
    verdict: str  # named, agree, no origin, elsewhere, not compared
    origin: dict[str, Any] | None
    seconds: float
    bits_part: bool = False  # the compare names it where the bits part (if it can)
    reads_unrecorded: bool = False  # it reads data no recorded op made (a parameter, ...)

    @property
    def size(self) -> str:
        if self.own_error >= CLEAR * RTOL:
            return "clear"
        return "sub-tolerance" if self.own_error < RTOL else "marginal"


@dataclass
class Pair:
    """A noise-only pair: A and B of one fresh seed, B in ``setting``, nothing planted."""

    family: str
    setting: str
    seed: int
    verdict: str  # bitwise, agree, no origin, origin, not compared
    origin: dict[str, Any] | None
    largest: float  # the largest op error the compare estimated


def count(outcomes: list[Outcome], **where: Any) -> int:
    return sum(all(getattr(o, k) == v for k, v in where.items()) for o in outcomes)


def share(part: int, whole: int) -> str:
    return f"{part} of {whole} ({100 * part / whole:.0f}%)" if whole else "-"


def planting_table(outcomes: list[Outcome]) -> Table:
    rows = []
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in outcomes:
        groups.setdefault((outcome.plan.family, outcome.plan.setting), []).append(outcome)
    for (family, setting), group in groups.items():
        made = [o for o in group if o.made]
        clear = [o for o in made if o.size == "clear"]
        marginal = [o for o in made if o.size == "marginal"]
        below = [o for o in made if o.size == "sub-tolerance" and o.inputs_same]
        said = ", ".join(
            f"{verdict} {n}"
            for verdict in ("agree", "no origin", "elsewhere", "not compared")
            if (n := count(below, verdict=verdict))
        )
        rows.append(
            [
                family,
                setting,
                f"{len(made)} of {len(group)} ({count(group, made=False, own_error=0.0)} "
                f"changed nothing)",
                share(count(clear, verdict="named"), len(clear)),
                str(count(clear, verdict="agree") + count(clear, verdict="no origin")),
                str(count(clear, verdict="elsewhere")),
                str(count(clear, verdict="not compared")),
                f"{count(marginal, verdict='named')} of {len(marginal)}",
                f"{len(below)} ({count(below, reads_unrecorded=True)} read unrecorded data)",
                str(count(below, verdict="named")),
                str(count(below, bits_part=True)),
                said or "-",
            ]
        )
    return Table(
        "Plantings named (14 plantings)",
        [
            "family",
            "B's setting",
            "made",
            "clear (>= 3x tol.) named exactly",
            "clear: agree or no origin",
            "clear: origin elsewhere",
            "clear: not compared",
            "marginal named",
            "sub-tolerance with A's input bits",
            "... the origin",
            "... named where the bits part",
            "... the verdict",
        ],
        rows,
        note=(
            "Targets: clear plantings named exactly in 100% without noise and 95% with "
            "it, none 'agree' or 'no origin', not compared 0; sub-tolerance plantings whose "
            "inputs have A's bits named where the bits part. 'made': plantings whose run's "
            "bits first part from the same run without it at the planted op; an output of "
            "zeros, or one bfloat16 holds exactly, is not changed ('changed nothing'); any "
            "other planting not made is a fault of the harness."
        ),
    )


def pair_table(pairs: list[Pair]) -> Table:
    groups: dict[tuple[str, str], list[Pair]] = {}
    for pair in pairs:
        groups.setdefault((pair.family, pair.setting), []).append(pair)
    rows = []
    for (family, setting), group in groups.items():
        counts = [
            sum(p.verdict == v for p in group)
            for v in ("bitwise", "agree", "no origin", "origin", "not compared")
        ]
        largest = [p.largest for p in group if not np.isnan(p.largest)]
        rows.append(
            [
                family,
                setting,
                str(len(group)),
                *map(str, counts),
                f"{max(largest):.2g}" if largest else "-",
            ]
        )
    total = [sum(p.verdict == v for p in pairs) for v in ("origin", "not compared")]
    return Table(
        "Noise-only pairs (14 plantings)",
        [
            "family",
            "B's setting",
            "pairs",
            "bit for bit",
            "agree",
            "differ, no origin",
            "origin",
            "not compared",
            "largest op error",
        ],
        rows,
        note=f"{len(pairs)} pairs: {total[0]} report an origin (target 0), {total[1]} could "
        "not be compared (target 0). 'largest op error': inf where a shape differs.",
    )


def missed_table(outcomes: list[Outcome], shown: int) -> Table:
    missed = [o for o in outcomes if o.made and o.size == "clear" and o.verdict != "named"]
    rows = []
    for o in missed[:shown]:
        p, origin = o.plan, o.origin or {}
        planted = p.module if p.phase == "module" else f"op {p.index} {p.name}"
        if "index" in origin:
            said = (
                f"op {origin['index']} {origin['op']} in {origin['module_path'] or '(no module)'}"
                f", error {origin['error']:.3g}, inputs {origin['input_error']:.3g}"
            )
        else:
            said = origin.get("error", "")
        rows.append(
            [p.family, p.setting, p.phase, p.change, planted, f"{o.own_error:.2g}", o.verdict, said]
        )
    return Table(
        "Clear plantings not named (14 plantings)",
        [
            "family",
            "setting",
            "phase",
            "change",
            "planted",
            "own error",
            "verdict",
            "reported origin",
        ],
        rows,
        note=f"{len(missed)} in all"
        + (f"; the first {shown} shown" if len(missed) > shown else ""),
    )
