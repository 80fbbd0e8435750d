"""The Markdown report: machine, main table, extra tables, notes."""

from __future__ import annotations

from benchmarks.harness import Result, format_stats


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(results: dict[str, Result], machine: dict[str, str], command: str, quick: bool) -> str:
    lines = [
        "# detctx benchmarks",
        "",
        f"Command: `{command}`"
        + (" (quick mode: short batches, numbers are rough)" if quick else ""),
        "",
        "Machine: " + "; ".join(f"{key}: {value}" for key, value in machine.items()),
        "",
        "Times are per call (per step, per await), median [interquartile range] over the "
        "repeats; every alternative was measured in the same process run, interleaved with "
        "detctx. Ratio = detctx median / alternative median.",
        "",
        "| scenario | detctx | median [IQR] | against | median [IQR] | ratio | target | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results.values():
        for row in result.rows:
            cells = [
                row.scenario,
                row.subject,
                format_stats(row.value),
                row.against or "-",
                format_stats(row.baseline),
                _ratio(row.ratio),
                row.target.describe() if row.target is not None else "-",
                row.status or "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    notes = [
        f"- {row.scenario}, {row.subject} vs {row.against or '-'}: {row.note}"
        for result in results.values()
        for row in result.rows
        if row.note and row.value is not None and row.baseline is not None
    ]
    if notes:
        lines += ["", "Notes:", "", *notes]
    for result in results.values():
        for table in result.tables:
            lines += ["", f"## {table.title}", ""]
            lines.append("| " + " | ".join(table.columns) + " |")
            lines.append("| " + " | ".join("---" for _ in table.columns) + " |")
            lines += ["| " + " | ".join(cells) + " |" for cells in table.rows]
            if table.note:
                lines += ["", table.note]
    return "\n".join(lines) + "\n"
