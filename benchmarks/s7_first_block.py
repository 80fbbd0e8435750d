"""Scenario 7: the first block of a fresh process, against ``import torch`` in the same process.

Every short script, every ``detctx run`` child and every test process pays
the first block once. Measured in fresh interpreters: ``import torch``, then
``import detctx`` and its first use (which loads the library), then the first
``with deterministic(seed=1234):`` enter+exit. The row also says whether the
block imported ``torch._inductor`` (torch's own ``use_deterministic_algorithms``
does, about 1 s on torch 2.13; detctx must not).
"""

from __future__ import annotations

from benchmarks.harness import Result, Row, Settings, Stats, Target, in_fresh_interpreter

SCENARIO = "7 first block"

_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
after_torch = time.perf_counter()
import detctx
detctx.deterministic
loaded = time.perf_counter()
with detctx.deterministic(seed=1234):
    pass
after_block = time.perf_counter()
print(json.dumps({
    "torch": after_torch - start,
    "block": after_block - loaded,
    "inductor": "torch._inductor" in sys.modules,
}))
"""


def run(settings: Settings) -> Result:
    repeats = 3 if settings.quick else 10
    runs = [in_fresh_interpreter(_CHILD) for _ in range(repeats)]
    imported = sum(1 for one in runs if one["inductor"])
    note = f"{repeats} fresh interpreters; torch._inductor imported by the block in {imported}"
    return Result(
        [
            Row(
                SCENARIO,
                "first deterministic() enter+exit in a fresh process",
                Stats.of([one["block"] for one in runs], 1),
                "import torch, in the same process",
                Stats.of([one["torch"] for one in runs], 1),
                Target("ratio", 0.02),
                note=note,
            ),
        ]
    )
