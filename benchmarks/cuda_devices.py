"""Scenarios 1 and 4 on the real CUDA devices of this machine (skipped without one).

Two configurations, each in its own interpreter: "initialised" (every CUDA
device woken before the blocks: their RNG states are read and written on
every block) and "uninitialised" (CUDA never woken: detctx must not wake it,
and seeds it lazily). The floor with initialised devices is the CPU floor
plus, per device, ``get_rng_state(i)`` and ``set_rng_state(state, i)`` and one
``manual_seed_all``; with uninitialised devices it is the CPU floor alone.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from benchmarks.devices import measure_devices, run_child
from benchmarks.harness import Result, Row, Settings, Stats, Table, Target, format_stats

SCENARIO = "1+4 cuda"
MEASURES = ("block", "capture", "restore", "fingerprint")
_TITLE = "Cost with the CUDA devices of this machine"
_COLUMNS = ["devices", "state", *MEASURES, "floor of a block"]


def child(initialised: bool, quick: bool) -> dict[str, Any]:
    """Measure one configuration in this (fresh) process."""
    import torch

    count = torch.cuda.device_count()
    if initialised:
        # As docs/usage.md advises: determinism and the cuBLAS workspace before CUDA wakes.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        for index in range(count):
            torch.ones(1, device=f"cuda:{index}")
    result = measure_devices(torch.cuda, count, initialised, quick)
    result["devices"] = count
    return result


def _run_child(initialised: bool, quick: bool) -> tuple[int, dict[str, Stats]]:
    # A child that wakes CUDA sets the cuBLAS workspace itself, before its first GEMM.
    data = run_child(
        "benchmarks.cuda_devices",
        [int(initialised), int(quick)],
        unset=("CUBLAS_WORKSPACE_CONFIG",),
    )
    count = int(data.pop("devices"))
    return count, {name: Stats(**fields) for name, fields in data.items()}


def run(settings: Settings) -> Result:
    import torch

    if not torch.cuda.is_available():
        absent = "not available: no CUDA device"
        return Result(
            [Row(SCENARIO, "block with CUDA devices", None, note=absent)],
            [
                Table(
                    _TITLE, _COLUMNS, [["0", "-", *("-" for _ in range(len(_COLUMNS) - 2))]], absent
                )
            ],
        )
    count, woken = _run_child(True, settings.quick)
    _, asleep = _run_child(False, settings.quick)
    rows = [
        Row(
            SCENARIO,
            f"block, {count} initialised CUDA device(s)",
            woken["block"],
            f"floor, {count} initialised CUDA device(s)",
            woken["floor"],
            Target("ratio", 1.15),
        ),
        Row(
            SCENARIO,
            f"block, {count} uninitialised CUDA device(s)",
            asleep["block"],
            "floor, no device touched",
            asleep["floor"],
            Target("ratio", 1.15),
            note="CUDA stays uninitialised: seeded lazily, the queued seed taken back on exit",
        ),
    ]
    table = Table(
        _TITLE,
        _COLUMNS,
        [
            [str(count), state, *(format_stats(stats[name]) for name in (*MEASURES, "floor"))]
            for state, stats in (("initialised", woken), ("uninitialised", asleep))
        ],
        note=f"Each configuration ran in its own interpreter, on {count} CUDA device(s).",
    )
    return Result(rows, [table])


if __name__ == "__main__":
    init, quick_flag = (int(arg) for arg in sys.argv[1:3])
    print(json.dumps(child(bool(init), bool(quick_flag))))
