"""Curves from the log files frameworks write: Lightning's metrics.csv, HF's trainer_state.json.

``detctx compare`` reads each file by its kind:

- a ``.csv`` file: a table with a header row, as Lightning's ``CSVLogger``
  writes ``metrics.csv`` (one row per logging call, empty cells for metrics
  not logged in that row); the curve is one column's non-empty cells, in
  order;
- a ``.json`` file: a Hugging Face ``trainer_state.json``; the curve is one
  key's values across ``log_history``, in order;
- a folder holding ``trainer_state.json`` or ``metrics.csv``: that file;
- anything else: a text log, read with the metric pattern.

The metric is ``--metric NAME``; by default the training loss (``loss`` in
``log_history``; in a CSV the first of :data:`TRAINING_LOSS_COLUMNS` it has).
Every file is untrusted input: anything malformed is a
:class:`~detctx.MetricsError` naming the file and what is wrong.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from detctx._basics import MetricsError
from detctx._cli.curves import METRIC_VALUE, Curve, Point, compile_pattern, read_log
from detctx._cli.paths import read_log_text

__all__ = [
    "TRAINING_LOSS_COLUMNS",
    "metric_lines",
    "metric_pattern",
    "read_csv_metrics",
    "read_curve",
    "read_trainer_state",
]

TRAINING_LOSS_COLUMNS: Final = (
    "train_loss",
    "train_loss_step",
    "loss",
    "train/loss",
    "training_loss",
    "train_loss_epoch",
)
"""The columns a CSV's training loss is looked for in, in order (Lightning's usual names)."""

_FOLDER_FILES: Final = ("trainer_state.json", "metrics.csv")


def read_curve(path: Path, *, pattern: str | None = None, metric: str | None = None) -> Curve:
    """The metric curve in the log at ``path``, read by its kind (see the module docs).

    ``pattern`` applies to text logs only; ``metric`` names a CSV column, a
    ``log_history`` key, or in a text log the name before ``:`` / ``=``.
    """
    if path.is_dir():
        path = _file_in_folder(path)
    suffix = path.suffix.lower()
    if suffix in (".csv", ".json"):
        if pattern is not None:
            raise MetricsError(
                f"--pattern reads text logs, and {path} is a {suffix[1:].upper()} file; "
                "choose its metric with --metric NAME instead"
            )
        text = _read_text(path)
        if suffix == ".csv":
            return read_csv_metrics(text, str(path), metric)
        return read_trainer_state(text, str(path), metric)
    if metric is not None:
        if pattern is not None:
            raise MetricsError("give --pattern or --metric, not both")
        return read_log(path, metric_pattern(metric), looked_for=metric_lines(metric))
    return read_log(path, compile_pattern(pattern))


def metric_pattern(name: str) -> re.Pattern[str]:
    """The regex for ``name: x``, ``name=x``, ``name x``, ``'name': x`` and ``'name': 'x'``
    in a text log."""
    if not name.strip():
        raise MetricsError("--metric needs a metric name, e.g. --metric eval_loss")
    # One space-or-separator group: either branch backtracks once per space, so a line
    # of the name and many spaces stays linear (see DEFAULT_PATTERN).
    return compile_pattern(
        rf"(?<![\w./-]){re.escape(name)}['\"]?(?:\s*[:=]\s*|\s+)" + METRIC_VALUE, linear=True
    )


def metric_lines(name: str) -> str:
    """What :func:`metric_pattern` looks for, in words, for an error message."""
    shown = name if name.isprintable() and len(name) <= 40 else repr(name[:40])
    return f"--metric {shown}: lines such as '{shown}: 0.5', '{shown}=0.5' or '{shown} 0.5'"


def read_csv_metrics(text: str, name: str, metric: str | None = None) -> Curve:
    """The curve of one column of a CSV table such as Lightning's ``metrics.csv``.

    Rows whose cell is empty are skipped; the ``step`` column, where there is
    one, gives each point's step. Raises :class:`~detctx.MetricsError`
    for a table without a header, a duplicated column, a row of the wrong
    width, a cell that is not a number, or a metric it does not have.
    """
    rows = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(rows, None)
        if header is None or not any(cell.strip() for cell in header):
            raise MetricsError(f"{name} is empty: expected a CSV header row, e.g. epoch,step,loss")
        columns = [cell.strip() for cell in header]
        _check_unique(columns, name)
        column = _choose(metric, columns, TRAINING_LOSS_COLUMNS, name, "column")
        index = columns.index(column)
        step_index = columns.index("step") if "step" in columns else None
        points = []
        for row in rows:
            if not row:
                continue
            line = rows.line_num
            if len(row) != len(columns):
                raise MetricsError(
                    f"{name}, line {line}: {len(row)} fields, but the header has {len(columns)}"
                )
            cell = row[index].strip()
            if not cell:
                continue
            value = _number(cell, f"{name}, line {line}, column {column!r}")
            step = None
            if step_index is not None and row[step_index].strip():
                step = _step(row[step_index].strip(), f"{name}, line {line}")
            points.append(Point(value, cell, line, step))
    except csv.Error as exc:
        raise MetricsError(f"{name}, line {rows.line_num}: not a valid CSV row ({exc})") from None
    return _nonempty(Curve(name, tuple(points)), column)


def read_trainer_state(text: str, name: str, metric: str | None = None) -> Curve:
    """The curve of one key across a Hugging Face ``trainer_state.json``'s ``log_history``.

    Entries without the key are skipped; an entry's ``step`` gives the
    point's step. Raises :class:`~detctx.MetricsError` for text that is
    not JSON, a state without a ``log_history`` list, an entry that is not an
    object, a value that is not a number, or a metric no entry has.
    """
    try:
        state = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MetricsError(
            f"{name} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise MetricsError(f"{name} is not valid JSON: {exc}") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise MetricsError(
            f"{name} has no 'log_history' list: expected a Hugging Face trainer_state.json "
            "(Trainer writes one into each checkpoint folder)"
        )
    for number, entry in enumerate(history, start=1):
        if not isinstance(entry, dict):
            raise MetricsError(
                f"{name}: log_history entry {number} is a {type(entry).__name__}, not an object"
            )
    keys = list(dict.fromkeys(key for entry in history for key in entry))
    key = _choose(metric, keys, ("loss",), name, "metric")
    points = []
    for number, entry in enumerate(history, start=1):
        if key not in entry:
            continue
        where = f"log_history entry {number}"
        raw = entry[key]
        value = _json_number(raw, f"{name}, {where}, {key!r}")
        step = entry.get("step")
        if step is not None and (type(step) is not int or step < 0):
            raise MetricsError(f"{name}, {where}: step {step!r} is not a non-negative integer")
        text_value = raw if isinstance(raw, str) else repr(value)
        points.append(Point(value, text_value, number, step, where))
    return _nonempty(Curve(name, tuple(points)), key)


def _check_unique(columns: list[str], name: str) -> None:
    # One pass with a set: columns.count() for each column took 29.4 s for a
    # header of 40,000 columns (benchmarks/hammer_patterns.py).
    seen: set[str] = set()
    for column in columns:
        if column in seen:
            raise MetricsError(f"{name}: the header names column {column[:40]!r} twice")
        seen.add(column)


def _file_in_folder(folder: Path) -> Path:
    for file_name in _FOLDER_FILES:
        if (folder / file_name).is_file():
            return folder / file_name
    raise MetricsError(
        f"{folder} is a folder without {' or '.join(_FOLDER_FILES)}; "
        "name a log file, a metrics.csv or a trainer_state.json"
    )


def _read_text(path: Path) -> str:
    # utf-8-sig: a byte-order mark (spreadsheet exports) is not part of the first name.
    return read_log_text(path, encoding="utf-8-sig")


def _choose(
    metric: str | None, names: Sequence[str], defaults: Sequence[str], file: str, kind: str
) -> str:
    if metric is not None:
        if metric in names:
            return metric
        wanted = repr(metric)
    else:
        for name in defaults:
            if name in names:
                return name
        wanted = "training loss (" + ", ".join(defaults) + ")"
    available = ", ".join(map(_shown, names[:20])) + (", ..." if len(names) > 20 else "")
    raise MetricsError(
        f"{file} has no {kind} {wanted}; it has: {available or 'none'}; "
        "choose one with --metric NAME"
    )


def _shown(name: str) -> str:
    """A name from the file as it can be shown on one line of an error."""
    return name if name.isprintable() and len(name) <= 40 else repr(name[:40])


def _number(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise MetricsError(f"{where}: {text[:40]!r} is not a number") from None


def _json_number(raw: Any, where: str) -> float:
    if type(raw) is float:
        return raw
    if type(raw) is int:
        try:
            return float(raw)
        except OverflowError:
            raise MetricsError(f"{where}: the integer is too large for a float") from None
    if isinstance(raw, str):
        return _number(raw.strip(), where)
    raise MetricsError(f"{where}: {str(raw)[:40]!r} is not a number")


def _step(text: str, where: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise MetricsError(f"{where}: step {text[:40]!r} is not an integer") from None
    if step < 0:
        raise MetricsError(f"{where}: step {step} is negative")
    return step


def _nonempty(curve: Curve, metric: str) -> Curve:
    if not curve.points:
        raise MetricsError(f"{curve.name} has no values of {metric!r}")
    return curve
