"""Scenario 6: ``import detctx`` after ``import torch, numpy``, in fresh interpreters.

``import detctx`` loads nothing but the package's ``__init__``; the library is
loaded by the first use of a public name, so a second row times the import
and that first use (``detctx.deterministic``) together.
"""

from __future__ import annotations

from benchmarks.harness import Result, Row, Settings, Stats, Target, in_fresh_interpreter

SCENARIO = "6 import"

_CHILD = """
import json, time
import numpy, torch
start = time.perf_counter()
import detctx
after_detctx = time.perf_counter()
detctx.deterministic
loaded = time.perf_counter()
print(json.dumps({"detctx": after_detctx - start, "loaded": loaded - start}))
"""


def run(settings: Settings) -> Result:
    repeats = 3 if settings.quick else 10
    samples = [in_fresh_interpreter(_CHILD) for _ in range(repeats)]
    return Result(
        [
            Row(
                SCENARIO,
                "import detctx (torch, numpy already imported)",
                Stats.of([one["detctx"] for one in samples], 1),
                target=Target("seconds", 0.05),
                note=f"{repeats} fresh interpreters",
            ),
            Row(
                SCENARIO,
                "import detctx and its first use (the library loaded)",
                Stats.of([one["loaded"] for one in samples], 1),
                target=Target("seconds", 0.05),
                note=f"{repeats} fresh interpreters",
            ),
        ]
    )
