"""Metric curves from training logs: extract, compare point for point, describe.

A curve is the sequence of metric values a log prints, one per matching line,
in order. Two curves agree when they have the same number of points and every
point is the same float by :func:`detctx._basics.equality.same_float` (bit for bit;
NaN equals NaN; ``-0.0`` differs from ``0.0``). Carriage returns count as line
ends, so progress-bar refreshes (tqdm, Lightning) are separate lines. A log
whose numbers show fewer than :data:`FULL_DIGITS` significant digits has
rounded them (Hugging Face 5.x prints 4, Lightning's progress bar 3
decimals, torchtitan 5): curves that agree then agree at that printed precision only.
Terminal colour codes are taken out of every line before it is read: torchtitan
colours its console log unless ``--metrics.disable_color_printing``, and a code
between ``step:`` and ``loss:`` would otherwise hide both.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import Final

from detctx._basics import MetricsError, same_float
from detctx._cli.hints import FrameworkSigns
from detctx._cli.log_environment import environment_of
from detctx._cli.paths import read_log_text

__all__ = [
    "DEFAULT_PATTERN",
    "FULL_DIGITS",
    "METRIC_VALUE",
    "PATTERN_REACH",
    "Curve",
    "CurveComparison",
    "Point",
    "compare",
    "compile_pattern",
    "digits_text",
    "extract",
    "parse_line",
    "printed_digits",
    "read_log",
    "short_names",
    "shortened",
    "significant_digits",
    "split_lines",
    "without_colours",
]

METRIC_VALUE: Final = (
    r"(?:tensor\(\s*|['\"])?"
    r"(?P<value>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?i:nan|inf(?:inity)?)(?!\w))"
)
"""A metric's number as logs print it: ``0.5``, ``1.2E+00``, ``nan``, quoted (``'0.5'``,
transformers 5.x) or in a printed tensor (``tensor(0.5000, ...)``); the group ``value``."""

# "\s*[:=]?\s*" would read the same lines, but a line of "loss" and n spaces
# then makes the engine try every split of the spaces between the two "\s*":
# 2,000 spaces took 0.86 s, 8,000 took 12.9 s (benchmarks/hammer_patterns.py).
# "\s*(?:[:=]\s*)?" matches the same text and backtracks once per space.
DEFAULT_PATTERN: Final = (
    r"(?i)(?<![\w.-])(?:(?:lm|train)[ _])?loss['\"]?\s*(?:[:=]\s*)?" + METRIC_VALUE
)
"""The default metric pattern: the first training loss on a line, in any letter case.

It matches ``lm loss: 1.234E+00`` (Megatron, MindSpeed), ``loss=0.123`` and
``train_loss=0.123`` (Lightning's progress bar), ``{'loss': 0.123, ...}``
(Hugging Face Trainer 4.x) and ``{'loss': '0.6704', ...}`` (5.x, quoted),
``Loss: 0.5``, ``loss: tensor(0.5000)`` (a printed tensor), ``loss 0.123``
and ``step 3 loss: 0.5``. It skips ``val_loss``, ``eval_loss``,
``test_loss`` and ``loss scale: 1.0``, and torchtitan's ``validate step: N
loss: x`` lines, so validation lines and Megatron's loss scale are not part
of the curve.
"""

_STEP: Final = re.compile(
    r"(?<![\w.])(?:global_step|step|iteration|iter)['\"]?\s*(?:[:=]\s*)?(\d+)", re.IGNORECASE
)
_LINE_END: Final = re.compile(r"\r\n|\r|\n")
# A CSI sequence, parameters read loosely: torchtitan's orange is "\033[38;2,180;60,0m",
# commas where the standard has semicolons.
_COLOUR: Final = re.compile(r"\x1b\[[\x20-\x3f]*[\x40-\x7e]")

PATTERN_REACH: Final = 4096
"""How many characters of a line a ``--pattern`` regex is searched in.

detctx's own patterns (the default, the step, ``--metric``'s) take time
linear in a line's length. A user's regex may not: a pattern that backtracks
could spend minutes on one long line and stall a run, so it only sees each
line's first 4,096 characters (metric lines are a few hundred). A metric
printed further along a line is not read with ``--pattern``."""

_linear_sources: Final = {DEFAULT_PATTERN}
_VALIDATION_LINE: Final = "validate step:"
"""torchtitan's validation lines (``validate step: 10  loss: 7.12345``), which the default
pattern would otherwise read as training losses."""


@dataclass(frozen=True)
class Point:
    """One metric value: its number, its text, its 1-based line, and the step the line names.

    ``where`` says where it was read when that is not a line of text (an entry of a
    JSON list, say); ``line`` is then that entry's 1-based number.
    """

    value: float
    text: str
    line: int
    step: int | None
    where: str | None = None


@dataclass(frozen=True)
class Curve:
    """The metric values of one run or log, in order, and the environment its log names
    (:func:`~detctx._cli.log_environment.environment_of`; empty when it names none)."""

    name: str
    points: tuple[Point, ...]
    environment: Mapping[str, str] = field(default_factory=dict)


def compile_pattern(pattern: str | None, *, linear: bool = False) -> re.Pattern[str]:
    """The metric regex: ``pattern`` or :data:`DEFAULT_PATTERN`.

    The value is the group named ``value``, else group 1, else the whole match.
    A user's pattern is searched in the first :data:`PATTERN_REACH`
    characters of each line; ``linear=True`` (a pattern detctx built, known
    to take linear time) lifts that. Raises ``ValueError`` for a pattern
    that does not compile.
    """
    source = DEFAULT_PATTERN if pattern is None else pattern
    try:
        compiled = re.compile(source)
    except re.error as exc:
        raise ValueError(f"bad metric pattern {source!r}: {exc}") from None
    if linear:
        _linear_sources.add(source)
    return compiled


def without_colours(text: str) -> str:
    """``text`` without terminal colour codes (``\\x1b[32m``)."""
    return _COLOUR.sub("", text) if "\x1b" in text else text


def split_lines(text: str) -> list[str]:
    """``text`` split at ``\\n``, ``\\r\\n`` and ``\\r``."""
    return _LINE_END.split(text)


def extract(lines: Iterable[str], pattern: re.Pattern[str], name: str = "log") -> Curve:
    """The curve of the first match of ``pattern`` on each line.

    Raises :class:`~detctx.MetricsError` when a match holds no number.
    """
    points = []
    for number, line in enumerate(lines, start=1):
        point = parse_line(line, number, pattern, name)
        if point is not None:
            points.append(point)
    return Curve(name, tuple(points))


def parse_line(line: str, number: int, pattern: re.Pattern[str], name: str) -> Point | None:
    """The metric point on one line, or ``None`` when the pattern does not match it."""
    line = without_colours(line)
    if pattern.pattern == DEFAULT_PATTERN and _VALIDATION_LINE in line:
        return None
    reach = len(line) if pattern.pattern in _linear_sources else PATTERN_REACH
    match = pattern.search(line, 0, reach)
    if match is None:
        return None
    if "value" in pattern.groupindex:
        text = match.group("value")
    elif pattern.groups:
        text = match.group(1)
    else:
        text = match.group(0)
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise MetricsError(
            f"{name}, line {number}: the metric pattern matched {match.group(0)!r}, which "
            "holds no number; put the number in a group, e.g. --pattern 'loss=(\\S+)'"
        ) from None
    step_match = _STEP.search(line)
    return Point(value, text, number, int(step_match.group(1)) if step_match else None)


def read_log(path: str | Path, pattern: re.Pattern[str], *, looked_for: str = "") -> Curve:
    """The curve in the log file at ``path``.

    Raises :class:`~detctx.MetricsError` for a file that cannot be read
    (:func:`~detctx._cli.paths.read_log_text`), or one in which no line matches
    (saying it looked for ``looked_for``, when given, rather than the regex).
    """
    path = Path(path)
    lines = split_lines(without_colours(read_log_text(path)))
    curve = replace(extract(lines, pattern, str(path)), environment=environment_of(lines))
    if not curve.points:
        signs = FrameworkSigns()
        for line in lines:
            signs.feed(line)
        raise MetricsError(no_points_message(str(path), pattern, signs.advice(), looked_for))
    return curve


def no_points_message(
    name: str, pattern: re.Pattern[str], advice: str = "", looked_for: str = ""
) -> str:
    """The error for a log without metric lines; ``advice`` for the framework that wrote it,
    ``looked_for`` what the pattern matches in words (else the pattern is shown)."""
    shown = looked_for or (
        "the default loss pattern" if pattern.pattern == DEFAULT_PATTERN else pattern.pattern
    )
    tail = advice or "pass --pattern to match your log"
    return f"no metric lines in {name} (looked for {shown}); {tail}"


FULL_DIGITS: Final = 9
"""Significant digits that tell any two float32 values apart; a log that prints fewer rounds."""


def significant_digits(text: str) -> int | None:
    """The significant digits ``text`` shows: 4 for ``0.6704``, ``1.234E+00`` and ``0.5000``.

    ``None`` for a text that shows none (``nan``, ``inf``, ``0.0``).
    """
    mantissa = re.split(r"[eE]", text.strip())[0].lstrip("+-").replace(".", "").lstrip("0")
    return len(mantissa) if mantissa.isdigit() else None


def digits_text(count: int) -> str:
    """``"4 significant digits"``, ``"1 significant digit"``."""
    return f"{count} significant digit" + ("" if count == 1 else "s")


def printed_digits(curves: Sequence[Curve]) -> int | None:
    """The most significant digits any point of ``curves`` shows, when that is fewer than
    :data:`FULL_DIGITS` (the logs round); ``None`` when the numbers are printed in full."""
    shown = [significant_digits(point.text) for curve in curves for point in curve.points]
    digits = max((count for count in shown if count is not None), default=None)
    return digits if digits is not None and digits < FULL_DIGITS else None


@dataclass(frozen=True)
class CurveComparison:
    """How several curves compare with the first.

    ``first`` is the 0-based index of the first point where any curve differs
    from the first curve (a value that differs, or a point only some curves
    have), ``None`` when all agree; ``differing`` counts the point indices
    where any curve differs and ``max_abs_diff`` is the largest absolute
    difference among values present in both.
    """

    curves: tuple[Curve, ...]
    first: int | None
    differing: int
    max_abs_diff: float

    @property
    def agree(self) -> bool:
        return self.first is None

    @property
    def length(self) -> int:
        return max(len(curve.points) for curve in self.curves)


def compare(curves: Sequence[Curve]) -> CurveComparison:
    """Compare every curve with the first, point for point."""
    if len(curves) < 2:
        raise ValueError("compare needs at least two curves")
    reference = curves[0].points
    length = max(len(curve.points) for curve in curves)
    first: int | None = None
    differing = 0
    max_abs = 0.0
    for index in range(length):
        differs = False
        for curve in curves[1:]:
            if index >= len(curve.points) or index >= len(reference):
                differs = True
                continue
            a, b = reference[index].value, curve.points[index].value
            if not same_float(a, b):
                differs = True
                gap = abs(a - b)
                max_abs = math.nan if math.isnan(gap) or math.isnan(max_abs) else max(max_abs, gap)
        if differs:
            differing += 1
            if first is None:
                first = index
    return CurveComparison(tuple(curves), first, differing, max_abs)


def short_names(names: Sequence[str]) -> list[str]:
    """File names cut to what tells them apart: the folders every one starts with dropped,
    and the folders every one ends with, before a shared file name, shown as ``...``.

    ``/home/me/runs/a/lightning_logs/version_0/metrics.csv`` and ``.../b/...`` read
    ``a/.../metrics.csv`` and ``b/.../metrics.csv``; names that are not paths (``run 1``),
    or that the cut would make the same, are kept whole.
    """
    parts = [PurePath(name).parts for name in names]
    if len(set(parts)) < len(parts) or not all(parts):
        return list(names)
    lead = 0
    while all(len(p) > lead + 1 for p in parts) and len({p[lead] for p in parts}) == 1:
        lead += 1
    rest = [p[lead:] for p in parts]
    tail = 0
    while all(len(p) > tail + 1 for p in rest) and len({p[-1 - tail] for p in rest}) == 1:
        tail += 1
    if tail >= 2:  # a shared file name and at least one shared folder before it
        rest = [(*p[: len(p) - tail], "...", p[-1]) for p in rest]
    shortened = [str(PurePath(*p)) for p in rest]
    return shortened if len(set(shortened)) == len(shortened) else list(names)


def shortened(comparison: CurveComparison) -> CurveComparison:
    """``comparison`` with its curves named by :func:`short_names`."""
    names = short_names([curve.name for curve in comparison.curves])
    curves = tuple(replace(c, name=n) for c, n in zip(comparison.curves, names))
    return replace(comparison, curves=curves)
