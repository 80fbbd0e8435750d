"""Two machines' ``detctx doctor --json`` reports, side by side: every row that differs.

The first step when runs on two machines differ: ``detctx doctor --json >
a.json`` on each, then ``detctx compare a.json b.json`` (or ``detctx doctor
--diff a.json b.json``). Rows are compared as the reports hold them; the
warnings are not compared, as they follow from the other rows. A report is
untrusted input: anything but the shape ``--json`` writes is a
:class:`~detctx.MetricsError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from detctx._basics import MetricsError
from detctx._cli.paths import read_log_text

__all__ = ["compare_reports", "doctor_reports", "read_report"]

_ROW_SECTIONS: Final = ("versions", "build", "cpu", "flags", "environment")
_ORDER: Final = ("versions", "build", "devices", "cpu", "flags", "environment")
_NEEDED: Final = ("versions", "flags", "environment")
_SCALARS: Final = (str, int, float, bool, type(None))
_MAX_ROWS: Final = 10_000


def doctor_reports(paths: Sequence[Path]) -> list[dict[str, Any]] | None:
    """The reports at ``paths`` when they are ``detctx doctor --json`` reports, ``None`` when
    none is (metric logs); one report and one other file is an error."""
    if not all(path.suffix.lower() == ".json" and path.is_file() for path in paths):
        return None
    texts = [read_log_text(path, encoding="utf-8-sig") for path in paths]
    found = [_report_keys(text) for text in texts]
    if not any(found):
        return None
    if not all(found):
        report, other = (paths[0], paths[1]) if found[0] else (paths[1], paths[0])
        raise MetricsError(
            f"{report} is a detctx doctor report but {other} is not: compare two reports "
            "(detctx doctor --json > a.json on each machine) or two metric logs"
        )
    return [_checked(text, str(path)) for text, path in zip(texts, paths)]


def read_report(path: Path) -> dict[str, Any]:
    """One ``detctx doctor --json`` report, checked."""
    return _checked(read_log_text(path, encoding="utf-8-sig"), str(path))


def compare_reports(reports: Sequence[dict[str, Any]], names: Sequence[str]) -> tuple[str, bool]:
    """The rows two reports give differently, side by side, and whether they agree."""
    rows = [_rows(report) for report in reports]
    keys = sorted(
        dict.fromkeys(key for table in rows for key in table), key=lambda k: _ORDER.index(k[0])
    )
    differing = [
        (section, name, *(_shown(section, table.get((section, name), _ABSENT)) for table in rows))
        for section, name in keys
        if len({_key(table.get((section, name), _ABSENT)) for table in rows}) > 1
    ]
    a, b = names
    if not differing:
        return f"the doctor reports of {a} and {b} agree on all {len(keys)} rows.", True
    header = ("part", "name", a, b)
    widths = [max(len(row[i]) for row in (header, *differing)) for i in range(3)]
    lines = [f"doctor reports DIFFER in {len(differing)} of {len(keys)} rows:"]
    for row in (header, *differing):
        cells = [cell.ljust(width) for cell, width in zip(row[:3], widths)]
        lines.append(("  " + "  ".join([*cells, row[3]])).rstrip())
    if any(row[0] == "build" for row in differing):
        lines.append(
            "build rows are what each torch was compiled with (torch.version.cuda is the CUDA "
            "of the build, also on a machine without a GPU); devices are the devices found."
        )
    lines.append(
        "Runs on these machines may differ for any of these rows; to find the op where they "
        "part, `detctx record -o a.trace -- python train.py` on each, then `detctx compare "
        "a.trace b.trace`."
    )
    return "\n".join(lines), False


class _Absent:
    pass


_ABSENT: Final = _Absent()


def _key(value: Any) -> str:
    """``value`` as text that tells every two values apart (``1`` from ``True`` too)."""
    return "(absent)" if value is _ABSENT else f"{type(value).__name__}:{json.dumps(value)}"


def _shown(section: str, value: Any) -> str:
    if value is _ABSENT:
        return "(not reported)"
    if value is None and section == "environment":
        return "(unset)"
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 80 and text.isprintable() else repr(text[:80])


def _rows(report: dict[str, Any]) -> dict[tuple[str, str], Any]:
    rows: dict[tuple[str, str], Any] = {}
    for section in _ROW_SECTIONS:
        for name, value in report.get(section, {}).items():
            rows[(section, name)] = value
    for device in report.get("devices", []):
        kind = str(device.get("type"))
        rows[("devices", f"{kind} count")] = device.get("count")
        for field in ("names", "capabilities"):
            if field in device:
                rows[("devices", f"{kind} {field}")] = ", ".join(map(str, device[field]))
    if not report.get("devices"):
        rows[("devices", "accelerators")] = "none (CPU only)"
    return rows


def _report_keys(text: str) -> bool:
    """Whether ``text`` is a JSON object with a report's parts at its top level (a
    ``trainer_state.json`` has ``log_history`` there)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and all(key in value for key in _NEEDED)


def _checked(text: str, name: str) -> dict[str, Any]:
    try:
        report = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MetricsError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(report, dict) or any(key not in report for key in _NEEDED):
        raise MetricsError(
            f"{name} is not a detctx doctor report: expected an object with "
            f"{', '.join(map(repr, _NEEDED))} (detctx doctor --json writes one)"
        )
    count = 0
    for section in _ROW_SECTIONS:
        values = report.get(section, {})
        if not isinstance(values, dict):
            raise MetricsError(f"{name}: {section!r} is a {type(values).__name__}, not an object")
        for key, value in values.items():
            if not isinstance(value, _SCALARS):
                raise MetricsError(
                    f"{name}: {section}.{key[:40]!r} is a {type(value).__name__}, not a value"
                )
        count += len(values)
    devices = report.get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        raise MetricsError(f"{name}: 'devices' is not a list of objects")
    for device in devices:
        for field in ("names", "capabilities"):
            if field in device and not isinstance(device[field], list):
                raise MetricsError(f"{name}: a device's {field!r} is not a list")
    if count + len(devices) > _MAX_ROWS:
        raise MetricsError(f"{name} has more than {_MAX_ROWS} rows: not a doctor report")
    return report
