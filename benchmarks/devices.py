"""Scenarios 1 and 4 with 1, 8 and 64 simulated accelerator devices.

The devices are the simulated NPU of ``tests/simulated_npu.py`` (a device
module backed by CPU generators, registered the way torch_npu registers
itself). It can be registered once per process, so every configuration runs
in its own interpreter. "initialised" devices have been woken (their RNG
states are read and written on every block); "uninitialised" ones have not
(detctx must neither wake them nor pay per device for them).

The floor of a block with initialised devices is the CPU floor plus, per
device, ``get_rng_state(i)`` and ``set_rng_state(state, i)``, and one
``manual_seed_all``; with uninitialised devices it is the CPU floor alone.
With initialised devices, deterministic algorithms are switched on before the
devices wake, as the core's warning for Ascend advises.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.harness import Result, Row, Settings, Stats, Table, Target, format_stats

SCENARIO = "1+4 devices"
ROOT = Path(__file__).resolve().parent.parent
COUNTS = (1, 8, 64)
MEASURES = ("block", "capture", "restore", "fingerprint")


def _load_simulated_npu() -> Any:
    path = ROOT / "tests" / "simulated_npu.py"
    spec = importlib.util.spec_from_file_location("simulated_npu", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the simulated NPU from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulated_npu"] = module
    spec.loader.exec_module(module)
    return module


def child(devices: int, initialised: bool, quick: bool) -> dict[str, Any]:
    """Measure one configuration in this (fresh) process."""
    import torch

    npu = _load_simulated_npu()
    npu.install(devices)
    if initialised:
        # As the core's warning advises for Ascend: determinism on before the device
        # wakes, so blocks do not change the flag (and warn) on every entry.
        torch.use_deterministic_algorithms(True)
        npu.init()
    return measure_devices(npu, devices, initialised, quick)


def measure_devices(module: Any, count: int, initialised: bool, quick: bool) -> dict[str, Any]:
    """A block, its floor and the snapshot calls with ``count`` devices of the device
    module ``module`` (woken or not, as ``initialised`` says); fails if one was woken."""
    import detctx
    from benchmarks import baselines
    from benchmarks.harness import measure, preserved_process_state, repeated

    block = detctx.deterministic(seed=baselines.SEED)

    def detctx_block() -> None:
        with block:
            pass

    def floor() -> None:
        if not initialised:
            baselines.floor_block()
            return
        states = [module.get_rng_state(i) for i in range(count)]

        def seed_devices() -> None:
            module.manual_seed_all(baselines.SEED)

        baselines.floor_block(seed_devices)
        for index, state in enumerate(states):
            module.set_rng_state(state, index)

    with preserved_process_state():
        state = detctx.capture()
        stats = measure(
            {
                "block": repeated(detctx_block),
                "floor": repeated(floor),
                "capture": repeated(detctx.capture),
                "restore": repeated(state.restore),
                "fingerprint": repeated(detctx.fingerprint),
            },
            Settings.make(quick),
        )
    if not initialised and module.is_initialized():
        raise RuntimeError("a block initialised a device the program had not used")
    return {name: vars(value) for name, value in stats.items()}


def _run_child(devices: int, initialised: bool, quick: bool) -> dict[str, Stats]:
    data = run_child("benchmarks.devices", [devices, int(initialised), int(quick)])
    return {name: Stats(**fields) for name, fields in data.items()}


def run_child(module: str, args: list[int], *, unset: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run ``python -m module args`` from the repository root, without the variables
    ``unset``, and return the JSON object on the last line of its output."""
    env = {name: value for name, value in os.environ.items() if name not in unset}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", module, *(str(arg) for arg in args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child {module} failed:\n{done.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return data


def _scaled(stats: Stats, factor: float) -> Stats:
    return replace(
        stats,
        median=stats.median * factor,
        q1=stats.q1 * factor,
        q3=stats.q3 * factor,
        low=stats.low * factor,
        high=stats.high * factor,
    )


def run(settings: Settings) -> Result:
    scan = {
        (count, initialised): _run_child(count, initialised, settings.quick)
        for initialised in (True, False)
        for count in COUNTS
    }
    low, mid, high = COUNTS
    rows = []
    for measure_name in MEASURES:
        rows.append(
            Row(
                SCENARIO,
                f"{measure_name}, {high} initialised devices",
                scan[high, True][measure_name],
                f"{measure_name}, {mid} initialised devices",
                scan[mid, True][measure_name],
                Target("ratio", high / mid),
                note=f"linear growth allows at most {high // mid}x",
            ),
        )
        # Each configuration runs in its own interpreter, and a busy machine moves whole
        # processes: compare uninitialised costs relative to each process's own floor
        # (which touches no device at all, so it cannot hide a per-device cost).
        many, one = scan[high, False], scan[low, False]
        rows.append(
            Row(
                SCENARIO,
                f"{measure_name} / own floor, {high} uninitialised devices",
                _scaled(many[measure_name], one["floor"].median / many["floor"].median),
                f"{measure_name} / own floor, {low} uninitialised device",
                one[measure_name],
                Target("ratio", 1.2),
                note="flat: within 1.2x (noise allowance), each normalised by its process's floor",
            ),
        )
    for initialised in (True, False):
        state = "initialised" if initialised else "uninitialised"
        rows.append(
            Row(
                SCENARIO,
                f"block, {high} {state} devices",
                scan[high, initialised]["block"],
                f"floor, {high} {state} devices",
                scan[high, initialised]["floor"],
                Target("ratio", 1.15),
            ),
        )
    table = Table(
        "Cost against the number of simulated devices",
        ["devices", "state", *MEASURES, "floor of a block"],
        [
            [
                str(count),
                "initialised" if initialised else "uninitialised",
                *(format_stats(stats[name]) for name in (*MEASURES, "floor")),
            ]
            for (count, initialised), stats in sorted(
                scan.items(), key=lambda kv: (-kv[0][1], kv[0][0])
            )
        ],
        note="Each configuration ran in its own interpreter with tests/simulated_npu.py.",
    )
    return Result(rows, [table])


if __name__ == "__main__":
    count, init, quick_flag = (int(arg) for arg in sys.argv[1:4])
    print(json.dumps(child(count, bool(init), bool(quick_flag))))
