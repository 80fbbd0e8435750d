"""``--plot``: the curves overlaid above, each curve minus the first below.

Each run keeps one colour in both panels (matplotlib's colour cycle, in run
order), the title says the outcome (which runs agree, where each other one
parts from the first), and the axes are named: the step when every point
carries one, and the metric.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detctx._basics import MissingDependencyError
from detctx._cli.curves import (
    Curve,
    CurveComparison,
    compare,
    digits_text,
    printed_digits,
    shortened,
)
from detctx._cli.plot_target import plot_format

__all__ = ["load_pyplot", "plot", "title"]

_TITLE_WIDTH = 90
"""Characters of a title line that fit above the 9-inch figure at the title's size."""


def plot(comparison: CurveComparison, path: str | Path, what: str = "metric") -> None:
    """Write a picture of ``comparison``; the suffix of ``path`` names the format.

    Needs matplotlib (``pip install 'detctx[plot]'``); raises
    :class:`~detctx.MissingDependencyError` without it. Files are named by what
    tells them apart (:func:`~detctx._cli.curves.short_names`), and a long title
    is wrapped, so neither is cut off at the figure's edge.
    """
    pyplot = load_pyplot()
    comparison = shortened(comparison)
    curves = comparison.curves
    figure, (top, bottom) = pyplot.subplots(2, 1, sharex=True, figsize=(9, 6.5))
    try:
        colours = [f"C{index % 10}" for index in range(len(curves))]
        by_step = _by_step(curves)
        reference = curves[0]
        parts = _parts(curves)
        for index, curve in enumerate(curves):
            # The first run widest: a later run identical to it shows as a thinner line
            # inside it, so neither hides the other.
            width = _width(index)
            same = f" (same as {reference.name})" if index and parts[index] is None else ""
            top.plot(
                _xs(curve, by_step),
                [point.value for point in curve.points],
                color=colours[index],
                linewidth=width,
                label=curve.name + same,
            )
        bottom.axhline(0.0, color=colours[0], linewidth=_width(0), label=f"{reference.name} (zero)")
        for index, curve in enumerate(curves[1:], start=1):
            count = min(len(curve.points), len(reference.points))
            gaps = [curve.points[i].value - reference.points[i].value for i in range(count)]
            bottom.plot(
                _xs(curve, by_step)[:count],
                gaps,
                color=colours[index],
                linewidth=_width(index),
                label=f"{curve.name} - {reference.name}",
            )
            part = parts[index]
            if part is not None and part < len(curve.points):
                x = _xs(curve, by_step)[part]
                for axes in (top, bottom):
                    axes.axvline(x, color=colours[index], linestyle=":", linewidth=1)
        bottom.xaxis.get_major_locator().set_params(integer=True)
        wrapped = [
            textwrap.fill(line, _TITLE_WIDTH) for line in title(comparison, what).split("\n")
        ]
        top.set_title("\n".join(wrapped), fontsize="medium")
        top.set_ylabel(what)
        bottom.set_ylabel(f"difference from {reference.name}")
        bottom.set_xlabel("step" if by_step else f"{what} value, in the order logged")
        top.legend(loc="best", fontsize="small")
        bottom.legend(loc="best", fontsize="small")
        figure.tight_layout()
        figure.savefig(str(path), format=plot_format(path))
    finally:
        pyplot.close(figure)


def title(comparison: CurveComparison, what: str = "metric") -> str:
    """The outcome in words: which runs agree with the first, where each other one parts."""
    comparison = shortened(comparison)
    curves = comparison.curves
    by_step = _by_step(curves)
    parts = _parts(curves)
    digits = printed_digits(curves)
    agreeing = [curves[0].name, *(c.name for c, part in zip(curves[1:], parts[1:]) if part is None)]
    length = len(curves[0].points)
    unit = "steps" if by_step else "values"
    how = "bit for bit" if digits is None else f"to the {digits_text(digits)} printed"
    if len(agreeing) == len(curves):
        together = "both" if len(curves) == 2 else f"all {len(curves)}"
        return f"{what}: {_names(agreeing)} agree {how} ({together}, at all {length} {unit})"
    lines = []
    if len(agreeing) > 1:
        lines.append(f"{_names(agreeing)} agree {how} at all {length} {unit}")
    for curve, part in zip(curves[1:], parts[1:]):
        if part is None:
            continue
        if part < min(len(curve.points), length):
            where = _label(curve, part, by_step)
            lines.append(f"first divergence between {curves[0].name} and {curve.name} at {where}")
        else:
            short, other = (curve, curves[0]) if len(curve.points) < length else (curves[0], curve)
            lines.append(
                f"{short.name} ends after {len(short.points)} {unit}, {other.name} goes on"
            )
    return f"{what}: " + "\n".join(lines)


def _width(index: int) -> float:
    return max(6.0 - 2.0 * index, 1.2)


def _names(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _parts(curves: Sequence[Curve]) -> list[int | None]:
    """For each curve, the 0-based index where it first differs from the first curve."""
    return [None] + [compare([curves[0], curve]).first for curve in curves[1:]]


def _by_step(curves: Sequence[Curve]) -> bool:
    """Whether every point names a step, rising along each curve: then x is the step."""
    for curve in curves:
        steps = [point.step for point in curve.points]
        if None in steps or any(b <= a for a, b in zip(steps, steps[1:])):  # type: ignore[operator]
            return False
    return True


def _xs(curve: Curve, by_step: bool) -> list[int]:
    if by_step:
        return [int(point.step) for point in curve.points]  # type: ignore[arg-type]
    return list(range(1, len(curve.points) + 1))


def _label(curve: Curve, index: int, by_step: bool) -> str:
    point = curve.points[index]
    return f"step {point.step}" if by_step else f"logged value {index + 1}"


def load_pyplot() -> Any:
    """matplotlib's pyplot on the non-interactive Agg backend, or a clear error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise MissingDependencyError(
            "--plot needs matplotlib: pip install 'detctx[plot]' (or pip install matplotlib)"
        ) from None
    return pyplot
