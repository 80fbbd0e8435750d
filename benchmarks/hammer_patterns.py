"""Time the ``detctx`` command's reading of hostile logs, before and after; print a table.

    python benchmarks/hammer_patterns.py            # the figures in docs/reliability.md
    python benchmarks/hammer_patterns.py --quick    # skips the old code's slowest rows

- a line of ``loss`` and n spaces (no number): the default loss pattern as it
  was (two ``\\s*`` around an optional separator) and as it is, searched
  directly, and read through ``detctx compare``'s reader;
- the step pattern, the same way, on ``loss: 0.5 step`` and n spaces;
- a ``--pattern`` that backtracks (``x\\s*\\s*(\\d+)``) on ``x`` and n spaces:
  without a reach, and with :data:`PATTERN_REACH`;
- a CSV header of n columns: the duplicate check as it was
  (``columns.count`` per column) and the whole ``read_csv_metrics``.

Each time is the best of ``--repeat`` tries (the machine is shared); the
ratio column divides the old time by the new one.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from detctx._cli.curves import DEFAULT_PATTERN, METRIC_VALUE, PATTERN_REACH, compile_pattern
from detctx._cli.logs import read_csv_metrics, read_curve

OLD_DEFAULT = r"(?i)(?<![\w.-])(?:(?:lm|train)[ _])?loss['\"]?\s*[:=]?\s*" + METRIC_VALUE
OLD_STEP = r"(?i)(?<![\w.])(?:global_step|step|iteration|iter)['\"]?\s*[:=]?\s*(\d+)"
NEW_STEP = r"(?i)(?<![\w.])(?:global_step|step|iteration|iter)['\"]?\s*(?:[:=]\s*)?(\d+)"
USER = r"x\s*\s*(\d+)"


def best(repeat: int, work: Callable[..., object], *arguments: object) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work(*arguments)
        times.append(time.perf_counter() - start)
    return min(times)


def old_duplicate_check(columns: list[str]) -> object:
    return sorted({c for c in columns if columns.count(c) > 1})


def row(what: str, old: float | None, new: float) -> None:
    shown_old = "-" if old is None else f"{old:.3f} s"
    ratio = "-" if old is None else f"{old / new:,.0f}x"
    print(f"| {what} | {shown_old} | {new:.4f} s | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the old code's slowest rows")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    slow = 8_000 if args.quick else 32_000
    old_default, new_default = re.compile(OLD_DEFAULT), re.compile(DEFAULT_PATTERN)
    old_step, new_step = re.compile(OLD_STEP), re.compile(NEW_STEP)
    user = re.compile(USER)
    print("| input | before | now | before / now |")
    print("| --- | --- | --- | --- |")
    for spaces in (2_000, 8_000, slow):
        line = "loss" + " " * spaces
        repeat = 1 if spaces > 8_000 else args.repeat
        row(
            f"default pattern, `loss` and {spaces:,} spaces",
            best(repeat, old_default.search, line),
            best(args.repeat, new_default.search, line),
        )
    for spaces in (10**6, 10**7):
        line = "loss" + " " * spaces
        row(f"default pattern, {spaces:,} spaces", None, best(1, new_default.search, line))
    line = "loss: 0.5 step" + " " * 8_000
    row(
        "step pattern, `loss: 0.5 step` and 8,000 spaces",
        best(args.repeat, old_step.search, line),
        best(args.repeat, new_step.search, line),
    )
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "a.log"
        log.write_text("loss" + " " * 10**6 + "\nstep 1 loss: 0.5\n")
        row(
            "`detctx compare`'s reader, a line of 10**6 spaces",
            None,
            best(args.repeat, read_curve, log),
        )
    for spaces in (2_000, 8_000):
        line = "x" + " " * spaces
        row(
            f"`--pattern '{USER}'`, `x` and {spaces:,} spaces",
            best(1, user.search, line),
            best(args.repeat, user.search, line, 0, PATTERN_REACH),
        )
    line = "x" + " " * 10**6
    compiled = compile_pattern(USER)
    row(
        f"the same, 10**6 spaces (reach {PATTERN_REACH:,})",
        None,
        best(args.repeat, compiled.search, line, 0, PATTERN_REACH),
    )
    for count in (20_000, 40_000, 200_000):
        columns = ["step", "loss", *(f"c{index}" for index in range(count))]
        text = ",".join(columns) + "\n1,0.5" + "," * count + "\n"
        old = None
        if count <= (20_000 if args.quick else 40_000):
            old = best(1, old_duplicate_check, columns)
        row(
            f"CSV header of {count:,} columns",
            old,
            best(args.repeat, read_csv_metrics, text, "wide.csv"),
        )


if __name__ == "__main__":
    main()
