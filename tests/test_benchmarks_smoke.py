"""The benchmark scripts run and produce a well-formed table (timings are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SINGLE_PROCESS = (
    "block",
    "seed_all",
    "steps",
    "snapshot",
    "numpy_floor",
    "locate",
    "elastic",
    "dcp",
)
START_UP = ("first_block", "pytest_startup")


def quick_run(tmp_path: Path, scenarios: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    """``run_all.py --quick --only scenarios``: its JSON rows and its Markdown table."""
    table, rows = tmp_path / "RESULTS.md", tmp_path / "rows.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run_all.py"),
            "--quick",
            "--only",
            ",".join(scenarios),
            "--out",
            str(table),
            "--json",
            str(rows),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(rows.read_text()), table.read_text()


@pytest.mark.slow
def test_quick_run_of_the_single_process_scenarios_writes_every_row(tmp_path: Path) -> None:
    data, text = quick_run(tmp_path, SINGLE_PROCESS)
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

    assert "| scenario | detctx | median [IQR] |" in text
    assert "deterministic() enter+exit" in text and "seed_all()" in text
    assert "capture()" in text and "fingerprint()" in text
    assert "## Floor of a full block, by part" in text
    assert "decorated coroutine await" in text and "decorated generator step" in text
    assert "recorded demo training step" in text and "recorded model step alone" in text
    assert 'elastic_loader(streams=["torch"])' in text
    assert "dcp.save with dcp_resume_state" in text and "## DCP checkpoint bytes" in text


@pytest.mark.slow
def test_the_start_up_scenarios_compare_against_torch_and_pytest_without_the_plugin(
    tmp_path: Path,
) -> None:
    data, text = quick_run(tmp_path, START_UP)
    rows = [row for name in START_UP for row in data["scenarios"][name]["rows"]]
    subjects = {row["subject"]: row for row in rows}
    first = subjects["first deterministic() enter+exit in a fresh process"]
    assert first["against"] == "import torch, in the same process"
    assert first["target"] == {"kind": "ratio", "limit": 0.02}
    assert "torch._inductor imported by the block in 0" in first["note"]
    pytest_rows = [row for row in rows if row["scenario"] == "8 pytest start-up"]
    assert len(pytest_rows) == 2
    for row in rows:
        assert row["status"] in ("met", "missed"), row
        assert row["value"]["median"] > 0 and row["baseline"]["median"] > 0 and row["ratio"] > 0
    for row in pytest_rows:
        assert row["against"] == "the same with -p no:detctx"
        assert row["target"] == {"kind": "ratio", "limit": 1.2}
    assert "| 7 first block |" in text and "| 8 pytest start-up |" in text


@pytest.mark.slow
def test_the_compare_alignment_scenario_times_each_pair_against_the_difflib_alignment(
    tmp_path: Path,
) -> None:
    data, text = quick_run(tmp_path, ("compare_alignment",))
    rows = data["scenarios"]["compare_alignment"]["rows"]
    subjects = [row["subject"] for row in rows]
    assert any("one extra op in the middle" in subject for subject in subjects)
    assert any("one extra layer call" in subject for subject in subjects)
    assert any("against itself" in subject for subject in subjects)
    for row in rows:
        assert row["status"] in ("met", "missed"), row
        assert row["against"] == "the same compare, difflib alignment (before)", row
        assert row["value"]["median"] > 0 and row["baseline"]["median"] > 0 and row["ratio"] > 0
        assert " paired" in row["note"], row
    assert "## align() alone (12 compare alignment)" in text


@pytest.mark.slow
def test_the_planting_harness_names_clear_plantings_without_noise_and_reports_every_pair(
    tmp_path: Path,
) -> None:
    data, text = quick_run(tmp_path, ("plantings",))
    scenario = data["scenarios"]["plantings"]
    (row,) = scenario["rows"]
    assert row["value"]["median"] > 0, row
    assert "mode entered before the recording" in row["note"], row
    tables = {table["title"]: table for table in scenario["tables"]}
    named = tables["Plantings named (14 plantings)"]["rows"]
    by_setting = {cells[1]: cells for cells in named}
    assert set(by_setting) == {"same", "onednn_off"}
    for cells in named:  # every planting changed the bits at its op, or changed nothing
        made, rest = cells[2].split(" of ")
        total, nothing = rest.split(" (")
        assert int(made) + int(nothing.split()[0]) == int(total) > 0, cells
    assert by_setting["same"][3].endswith("(100%)"), by_setting["same"]
    assert by_setting["same"][4] == "0", by_setting["same"]  # none "agree" or "no origin"
    pairs = tables["Noise-only pairs (14 plantings)"]["rows"]
    assert sum(int(cells[2]) for cells in pairs) == 4
    assert "## Plantings named (14 plantings)" in text
    assert "## Noise-only pairs (14 plantings)" in text


@pytest.mark.slow
def test_the_record_cost_scenario_times_each_model_against_its_plain_step(tmp_path: Path) -> None:
    data, text = quick_run(tmp_path, ("record_cost",))
    scenario = data["scenarios"]["record_cost"]
    rows = scenario["rows"]
    assert len(rows) == 3  # the quick models: GPT-2, the LSTM, nanoGPT tiny
    for row in rows:
        assert row["against"] == "the same steps, unrecorded", row
        assert row["value"]["median"] > 0 and row["baseline"]["median"] > 0, row
        assert " ops a step; " in row["note"] and " us an op beyond" in row["note"], row
        assert "recorded with no helper thread: " in row["note"], row
        assert "with no summaries (the recorder's own work per op): " in row["note"], row
    # What the target leaves an op, only where the model has a target (nanoGPT tiny has not).
    budgets = ["the target leaves " in row["note"] for row in rows]
    assert budgets == [True, True, False], rows
    (table,) = scenario["tables"]
    assert [cells[0] for cells in table["rows"]] == ["gpt2", "lstm", "nanogpt-tiny"]
    assert table["columns"][-4:] == [
        "recorded in line",
        "recorded, no summaries",
        "per op",
        "per op at the target",
    ]
    assert [cells[-1] == "-" for cells in table["rows"]] == [False, False, True]
    assert "## Recording cost per model" in text
