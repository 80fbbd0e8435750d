"""Run every benchmark scenario and write the Markdown table.

    python benchmarks/run_all.py --out benchmarks/RESULTS.md
    python benchmarks/run_all.py --quick --only block,snapshot   # a fast smoke run

A scenario whose API is missing from this build, or that fails, is reported
in the table ("not available: ..." / "failed: ...") and the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: make the repository root importable so ``benchmarks`` resolves.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCENARIOS = {
    "block": "benchmarks.s1_block",
    "seed_all": "benchmarks.s2_seed_all",
    "steps": "benchmarks.s3_steps",
    "snapshot": "benchmarks.s4_snapshot",
    "distributed": "benchmarks.s5_distributed",
    "import": "benchmarks.s6_import",
    "devices": "benchmarks.devices",
    "numpy_floor": "benchmarks.numpy_floor",
    "cuda": "benchmarks.cuda_devices",
    "first_block": "benchmarks.s7_first_block",
    "pytest_startup": "benchmarks.s8_pytest_startup",
    "locate": "benchmarks.s9_locate",
    "elastic": "benchmarks.elastic_loader",
    "locate_speed": "benchmarks.s10_locate_speed",
    "dcp": "benchmarks.dcp_resume",
    "compare_alignment": "benchmarks.s12_compare_alignment",
    "plantings": "benchmarks.s14_plantings",
    "record_cost": "benchmarks.s15_record_cost",
}


def main(argv: list[str] | None = None) -> int:
    from benchmarks import machine, report
    from benchmarks.harness import Result, Row, Settings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the Markdown table here")
    parser.add_argument("--json", type=Path, help="also write every row as JSON here")
    parser.add_argument("--quick", action="store_true", help="short batches, few repeats")
    parser.add_argument(
        "--only",
        default=",".join(SCENARIOS),
        help=f"comma-separated scenarios to run (default: all of {', '.join(SCENARIOS)})",
    )
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")

    settings = Settings.make(args.quick)
    results: dict[str, Result] = {}
    for name in chosen:
        started = time.perf_counter()
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        try:
            results[name] = importlib.import_module(SCENARIOS[name]).run(settings)
        except Exception as exc:
            traceback.print_exc()
            results[name] = Result([Row(name, name, None, note=f"failed: {exc!r}")])
        print(f"[{name}] {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    command = "python benchmarks/run_all.py " + " ".join(
        shlex.quote(arg) for arg in (sys.argv[1:] if argv is None else argv)
    )
    text = report.markdown(results, machine.describe(), command.strip(), args.quick)
    if args.out is not None:
        args.out.write_text(text)
    else:
        print(text)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine.describe(),
                    "quick": args.quick,
                    "scenarios": {
                        name: {
                            "rows": [row.as_dict() for row in result.rows],
                            "tables": [vars(table) for table in result.tables],
                        }
                        for name, result in results.items()
                    },
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
