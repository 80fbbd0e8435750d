"""How a comparison of curves is told: agreement and at what precision, or where and how
they part, a table around that point, and what to look at when they part at the start."""

from __future__ import annotations

from collections.abc import Sequence

from detctx._basics import same_float
from detctx._cli.curves import (
    Curve,
    CurveComparison,
    compare,
    digits_text,
    printed_digits,
    shortened,
)
from detctx._cli.hints import different_start, two_environments
from detctx._cli.log_environment import environment_differences

__all__ = ["describe"]

_FULL_PRECISION_ADVICE = (
    "for every bit, print the metric with 9 or more significant digits (f'{loss:.9g}'), or "
    "compare files that keep full precision with detctx compare (Lightning: each run's "
    "CSVLogger metrics.csv; Hugging Face: each run's trainer_state.json)"
)


_TORCHTITAN_DIGITS = (
    "torchtitan prints its loss with 5 decimals (loss: {:8.5f}) and writes no text file "
    "with more: to compare every bit, record each run, `detctx record -o a.trace -- "
    "torchrun ... -m torchtitan.train ...`, and `detctx compare a.trace b.trace`."
)


def describe(
    comparison: CurveComparison,
    what: str = "metric",
    *,
    start: str | None = None,
    cause: str = "",
    notes: str = "",
    one_environment: bool = True,
) -> str:
    """A summary of the comparison, a table around the first divergence, and the verdict.

    Curves of different lengths (a run that stopped early, a truncated log)
    differ; the summary says where the shorter ones end, and how the points
    all curves have compare. Files are named by what tells them apart
    (:func:`~detctx._cli.curves.short_names`). Curves that differ at their first
    point are followed by ``start`` (``""``: nothing), by default by
    :func:`~detctx._cli.hints.different_start` with ``cause`` (the likely causes when
    ``""``); ``notes`` end every verdict. ``one_environment=False`` (logs, which may
    come from two machines): the start is told as either two environments or a
    different start, and curves that show two environments (the versions and devices
    their logs print) are said to be expected to differ.
    """
    comparison = shortened(comparison)
    environments: list[str] | None = None
    if not one_environment:
        curves = comparison.curves
        environments = environment_differences(
            [curve.name for curve in curves], [curve.environment for curve in curves]
        )
    text = _verdict(comparison, what, start, cause, environments)
    if environments and not comparison.agree and _parted_later(comparison):
        notes = "\n".join(filter(None, [two_environments(environments), notes]))
    return f"{text}\n{notes}" if notes else text


def _parted_later(comparison: CurveComparison) -> bool:
    """Whether the curves part after the first point all of them have (the start is
    then told by the verdict itself)."""
    common = min(len(curve.points) for curve in comparison.curves)
    if common == 0:
        return True
    within = compare([Curve(c.name, c.points[:common]) for c in comparison.curves])
    return within.first != 0


def _verdict(
    comparison: CurveComparison,
    what: str,
    start: str | None,
    cause: str,
    environments: Sequence[str] | None,
) -> str:
    curves = comparison.curves
    lines = []
    counts = ", ".join(f"{curve.name}: {len(curve.points)}" for curve in curves)
    if comparison.agree:
        points = curves[0].points
        values = f"{what} value" if len(points) == 1 else f"{what} values"
        lines.append(
            f"{len(curves)} curves agree {_how(curves)} on all {len(points)} {values} "
            f"(first {points[0].text}, last {points[-1].text})."
        )
        digits = printed_digits(curves)
        if digits is not None:
            lines.append(
                f"The logs print {digits_text(digits)}, so the values may still differ "
                f"beyond them; {_FULL_PRECISION_ADVICE}."
            )
            if any(curve.environment.get("framework") == "torchtitan" for curve in curves):
                lines.append(_TORCHTITAN_DIGITS)
        return "\n".join(lines)
    first = comparison.first
    assert first is not None
    lines.append(f"points per curve: {counts}")
    lines.append(_table(curves, max(0, first - 2), min(comparison.length, first + 4)))
    common = min(len(curve.points) for curve in curves)
    if common < comparison.length:
        lines.append(_lengths(comparison, common, start, cause, environments))
        return "\n".join(lines)
    lines.append(
        f"curves DIFFER: first divergence at point {first + 1} of {comparison.length}"
        f"{_where(curves, first)}{_parting(curves, first)}; {comparison.differing} of "
        f"{comparison.length} points differ, max abs difference {comparison.max_abs_diff:.6g}."
    )
    start_line = _start_line(comparison.length, start, cause, environments)
    return "\n".join(lines) + (start_line if first == 0 else "")


def _how(curves: Sequence[Curve]) -> str:
    digits = printed_digits(curves)
    if digits is None:
        return "bit for bit"
    return f"at the printed precision ({digits_text(digits)})"


def _lengths(
    comparison: CurveComparison,
    common: int,
    start: str | None,
    cause: str,
    environments: Sequence[str] | None,
) -> str:
    """The verdict for curves of different lengths: where each short one ends, then the
    comparison of the ``common`` points every curve has."""
    ends = []
    for curve in comparison.curves:
        if len(curve.points) == comparison.length:
            continue
        if curve.points:
            last = curve.points[-1]
            step = f"step {last.step}, " if last.step is not None else ""
            ends.append(
                f"{curve.name} ends after point {len(curve.points)} ({step}line {last.line})"
            )
        else:
            ends.append(f"{curve.name} has no points")
    head = f"curves DIFFER in length: {comparison.length} points in the longest, {'; '.join(ends)}."
    if common == 0:
        return head
    within = compare([Curve(c.name, c.points[:common]) for c in comparison.curves])
    if within.agree:
        return (
            f"{head} The {common} points all curves have agree {_how(comparison.curves)}; "
            "a run stopped early or a log was cut short."
        )
    assert within.first is not None
    return (
        f"{head} Within the {common} points all curves have: first divergence at point "
        f"{within.first + 1}{_where(comparison.curves, within.first)}"
        f"{_parting(comparison.curves, within.first)}; {within.differing} of {common} differ, "
        f"max abs difference {within.max_abs_diff:.6g}."
    ) + (_start_line(common, start, cause, environments) if within.first == 0 else "")


def _start_line(
    points: int, start: str | None, cause: str, environments: Sequence[str] | None
) -> str:
    text = different_start(points, cause, environments=environments) if start is None else start
    return "\n" + text if text else ""


def _where(curves: Sequence[Curve], index: int) -> str:
    for curve in curves:
        if index < len(curve.points):
            point = curve.points[index]
            # "step" is the log's own count (often from 0); points count from 1.
            step = f"logged as step {point.step}, " if point.step is not None else ""
            place = point.where or f"line {point.line}"
            return f" ({step}{place} of {curve.name})"
    return ""


def _parting(curves: Sequence[Curve], index: int) -> str:
    """Which curves part from the first at point ``index``, and which still agree there."""
    reference = curves[0].points[index].value if index < len(curves[0].points) else None

    def agrees(curve: Curve) -> bool:
        points = curve.points
        return (
            reference is not None
            and index < len(points)
            and same_float(reference, points[index].value)
        )

    part = [curve.name for curve in curves[1:] if not agrees(curve)]
    agree = [curve.name for curve in curves[1:] if agrees(curve)]
    text = f": {', '.join(part)} {'parts' if len(part) == 1 else 'part'} from {curves[0].name}"
    return text + (
        f" there ({', '.join(agree)} still {'agrees' if len(agree) == 1 else 'agree'})"
        if agree
        else " there"
    )


def _table(curves: Sequence[Curve], start: int, stop: int) -> str:
    reference = curves[0].points
    columns = []
    marks = set()
    for curve in curves:
        cells = [curve.name]
        for index in range(start, stop):
            if index >= len(curve.points):
                cells.append("-")
                marks.add("-")
                continue
            point = curve.points[index]
            same = index < len(reference) and same_float(reference[index].value, point.value)
            cells.append(point.text + ("" if same else " *"))
            marks.update(() if same else "*")
        columns.append(cells)
    widths = [max(len(cell) for cell in cells) for cells in columns]
    labels = ["point", *(str(index + 1) for index in range(start, stop))]
    rows = [
        f"  {label:>5}  " + "  ".join(cells[row].ljust(w) for cells, w in zip(columns, widths))
        for row, label in enumerate(labels)
    ]
    legend = {"*": "* differs from the first curve", "-": "- the curve has no such point"}
    shown = [text for mark, text in legend.items() if mark in marks]
    if shown:
        rows.append(f"  ({'; '.join(shown)})")
    return "\n".join(row.rstrip() for row in rows)
