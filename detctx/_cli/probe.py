"""``detctx doctor --probe``: print which ops are nondeterministic on each device here."""

from __future__ import annotations

import json
from collections.abc import Sequence

from detctx._proving import SAMPLE_SECONDS, TIMED_ROUNDS, ProbeReport, ProbeRow, run_probe

__all__ = ["format_report", "main"]

_COLUMNS = ("op", "device", "identical off", "identical on", "raises when on", "slowdown on")


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _cells(row: ProbeRow) -> tuple[str, ...]:
    if row.error is not None:
        return (row.op, row.device, "-", "-", "-", f"failed: {row.error}")
    slowdown = "-" if row.slowdown is None else f"{row.slowdown:.3g}x"
    if row.slowdown is not None and not row.measurable:
        slowdown = "no measurable slowdown"
    return (
        row.op,
        row.device,
        _yes_no(row.identical_off),
        _yes_no(row.identical_on),
        "YES" if row.raises else "no",
        slowdown,
    )


def format_report(report: ProbeReport) -> str:
    """The table, one row per op and device, then a summary and the notes."""
    table = [_COLUMNS, *(_cells(row) for row in report.rows)]
    widths = [max(len(cells[i]) for cells in table) for i in range(len(_COLUMNS) - 1)]
    out = [
        f"probe: each op run {report.runs} times with deterministic algorithms off, "
        f"then {report.runs} times on; 'identical' means bit for bit",
        f"slowdown on: time on / time off, the median of {TIMED_ROUNDS} pairs timed back to "
        f"back (each a batch of calls lasting {SAMPLE_SECONDS * 1000:.0f} ms or more; CPU "
        "time on the cpu, wall-clock time around a synchronize on a device): a guide, not a "
        "benchmark; 'no measurable slowdown' when the pairs' own spread around the median "
        "(from the 2nd smallest to the 2nd largest ratio) holds 1x",
    ]
    for cells in table:
        out.append(
            "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + "  " + cells[-1]
        )
    differ = report.nondeterministic()
    raising = [row for row in report.rows if row.raises]
    out.append(
        f"{len(differ)} op(s) gave different bits from run to run, "
        f"{len(raising)} raise under torch.use_deterministic_algorithms(True)"
    )
    out += [f"  {row.op} on {row.device}: {row.detail}" for row in raising if row.detail]
    out += [f"note: {note}" for note in report.notes]
    return "\n".join(out)


def main(device_types: Sequence[str] | None, *, as_json: bool) -> int:
    """Run the probe on ``device_types`` (default: every one here) and print it."""
    report = run_probe(device_types)
    print(json.dumps(report.as_dict(), indent=2) if as_json else format_report(report))
    return 0
