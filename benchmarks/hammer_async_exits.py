"""Hammer out-of-order exits of blocks in overlapping asyncio tasks (a documented misuse).

    python benchmarks/hammer_async_exits.py --rounds 400

Each round seeds the caller's RNGs, runs asyncio tasks whose ``with
detctx.deterministic(...)`` blocks overlap (each task sleeps a random 0-3 ms
between draws, so the exits come in any order), catches the
``OutOfOrderExitError`` each affected block raises, and counts the rounds after
which the caller's RNG state (``detctx.fingerprint()``) is not what it was.
Scenarios: two tasks; three tasks; two tasks each holding an outer and an inner
block. The figures are those quoted in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import numpy as np
import torch

import detctx

SCENARIOS = ("two tasks", "three tasks", "nested blocks in two tasks")


async def _task(seed: int, delays: list[float], nested: bool) -> None:
    try:
        with detctx.deterministic(seed=seed):
            if nested:
                with detctx.deterministic(seed=seed + 100):
                    await _draws(delays)
            else:
                await _draws(delays)
    except detctx.OutOfOrderExitError:
        pass


async def _draws(delays: list[float]) -> None:
    for delay in delays:
        await asyncio.sleep(delay)
        random.random()
        np.random.rand()
        torch.rand(1)


async def _overlapping(delays: list[list[float]], nested: bool) -> None:
    await asyncio.gather(*(_task(seed, d, nested) for seed, d in enumerate(delays)))


def moved_rounds(scenario: str, rounds: int, timing: random.Random) -> int:
    """Rounds of ``scenario`` after which the caller's RNG state had moved."""
    tasks = 3 if scenario == "three tasks" else 2
    moved = 0
    for _ in range(rounds):
        random.seed(7)
        np.random.seed(7)
        torch.manual_seed(7)
        before = detctx.fingerprint()
        delays = [[timing.uniform(0, 0.003) for _ in range(3)] for _ in range(tasks)]
        asyncio.run(_overlapping(delays, nested=scenario.startswith("nested")))
        moved += detctx.fingerprint() != before
    assert detctx.open_blocks() == ()
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    timing = random.Random(3)
    figures = {
        scenario: f"{moved_rounds(scenario, args.rounds, timing)} of {args.rounds}"
        for scenario in SCENARIOS
    }
    print(json.dumps({"caller's RNG moved": figures}, indent=2))


if __name__ == "__main__":
    main()
