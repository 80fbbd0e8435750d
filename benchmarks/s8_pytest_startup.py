"""Scenario 8: pytest start-up with detctx's plugin, against the same run with ``-p no:detctx``.

Installing detctx installs its pytest plugin into every pytest run of that
environment, including projects that never use torch. Measured in fresh
processes, in a folder of its own (no project conftest): ``pytest --help``,
and a one-test file that imports nothing, each with the plugin and with
``-p no:detctx``, taking turns. Hypothesis's plugin is off in both (it imports
hypothesis, about 1 s, when tests are collected), so that the figures are
pytest's and detctx's own.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import Result, Row, Settings, Stats, Target

SCENARIO = "8 pytest start-up"

_TEST = "def test_sum():\n    assert sum([1, 2]) == 3\n"
_QUIET = ("-p", "no:hypothesispytest")


def _seconds(folder: Path, args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *_QUIET, *args],
        capture_output=True,
        timeout=300,
        cwd=folder,
        check=True,
    )
    return time.perf_counter() - start


def run(settings: Settings) -> Result:
    repeats = 3 if settings.quick else 10
    cases = {"pytest --help": ["--help"], "pytest on a one-test file, no torch": ["-q"]}
    rows = []
    with tempfile.TemporaryDirectory(prefix="detctx-bench-") as name:
        folder = Path(name)
        (folder / "test_plain.py").write_text(_TEST)
        for subject, args in cases.items():
            with_plugin: list[float] = []
            without: list[float] = []
            for _ in range(repeats):
                with_plugin.append(_seconds(folder, args))
                without.append(_seconds(folder, [*args, "-p", "no:detctx"]))
            rows.append(
                Row(
                    SCENARIO,
                    f"{subject}, with the detctx plugin",
                    Stats.of(with_plugin, 1),
                    "the same with -p no:detctx",
                    Stats.of(without, 1),
                    Target("ratio", 1.2),
                    note=f"{repeats} fresh processes each, taking turns",
                )
            )
    return Result(rows)
