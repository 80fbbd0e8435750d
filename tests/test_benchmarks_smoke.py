"""The benchmark scripts run and produce a well-formed table (timings are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SINGLE_PROCESS = ("block", "seed_all", "steps", "snapshot", "numpy_floor", "locate")


def test_quick_run_of_the_single_process_scenarios_writes_every_row(tmp_path: Path) -> None:
    table, rows = tmp_path / "RESULTS.md", tmp_path / "rows.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run_all.py"),
            "--quick",
            "--only",
            ",".join(SINGLE_PROCESS),
            "--out",
            str(table),
            "--json",
            str(rows),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr

    data = json.loads(rows.read_text())
    assert set(data["scenarios"]) == set(SINGLE_PROCESS)
    assert data["machine"]["torch"] and data["machine"]["numpy"]
    for name, scenario in data["scenarios"].items():
        assert scenario["rows"], f"{name} reported no rows"
        for row in scenario["rows"]:
            assert not row["status"].startswith("failed"), row
            if row["value"] is None:
                assert row["status"].startswith(("not available", "not installed")), row
                continue
            assert row["value"]["median"] > 0 and row["value"]["low"] > 0, row
            if row["baseline"] is not None:
                assert row["baseline"]["median"] > 0 and row["ratio"] > 0, row
            if row["target"] is not None and row["ratio"] is not None:
                assert row["status"] in ("met", "missed"), row

    text = table.read_text()
    assert "| scenario | detctx | median [IQR] |" in text
    assert "deterministic() enter+exit" in text and "seed_all()" in text
    assert "capture()" in text and "fingerprint()" in text
    assert "## Floor of a full block, by part" in text
    assert "recorded demo training step" in text and "recorded model step alone" in text
