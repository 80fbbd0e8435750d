"""Scenario 3: per-step cost of a decorated generator and of a decorated coroutine's await.

A decorated generator (or coroutine) runs in its own RNG world: every resume
swaps its state in and the caller's out, and every yield (or suspending
await) swaps them back. Its floor is the undecorated step plus two raw
captures and two raw restores of the Python, NumPy and torch CPU states.

Whether this build gives generators and coroutines their own world is probed
by behaviour (the body's first draw must be the seeded one, and the caller's
state must be untouched by a step), not by name; where it does not, the rows
say "not available".
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import detctx
from benchmarks.baselines import SEED, raw_capture, raw_restore
from benchmarks.harness import Result, Row, Runner, Settings, Target, measure
from benchmarks.harness import preserved_process_state as preserved

SCENARIO = "3 generator/coroutine step"
MISSING = (
    "not available: deterministic(...) does not give {what} their own RNG world in this "
    "build (the decorator forms of issue 3)"
)


def _seeded_world() -> tuple[Any, Any, Any]:
    saved = raw_capture()
    random.seed(SEED)
    np.random.seed(SEED)
    torch.default_generator.manual_seed(SEED)
    world = raw_capture()
    raw_restore(saved)
    return world


def probe_generator() -> str | None:
    """None if decorated generator functions are isolated, else why not."""
    try:

        @detctx.deterministic(seed=SEED)
        def draws() -> Iterator[float]:
            while True:
                yield random.random()

        expected = random.Random(SEED).random()
        before = random.getstate()
        steps = draws()
        try:
            first = next(steps)
            untouched = random.getstate() == before
        finally:
            steps.close()
    except Exception as exc:
        return f"not available: decorating a generator function failed ({exc!r})"
    return None if first == expected and untouched else MISSING.format(what="generators")


def probe_coroutine() -> str | None:
    """None if decorated coroutine functions are isolated, else why not."""
    try:

        @detctx.deterministic(seed=SEED)
        async def draw() -> float:
            await asyncio.sleep(0)
            return random.random()

        expected = random.Random(SEED).random()
        before = random.getstate()
        loop = asyncio.new_event_loop()
        try:
            first = loop.run_until_complete(draw())
        finally:
            loop.close()
        untouched = random.getstate() == before
    except Exception as exc:
        return f"not available: decorating a coroutine function failed ({exc!r})"
    return None if first == expected and untouched else MISSING.format(what="coroutines")


def _generator_runners() -> dict[str, Runner]:
    def plain() -> Iterator[None]:
        while True:
            yield

    decorated_steps = detctx.deterministic(seed=SEED)(plain)()
    plain_steps = plain()
    floor_steps = plain()
    body = [_seeded_world()]

    def step_floor(n: int) -> None:
        for _ in range(n):
            caller = raw_capture()
            raw_restore(body[0])
            next(floor_steps)
            body[0] = raw_capture()
            raw_restore(caller)

    def stepper(steps: Iterator[None]) -> Runner:
        def run(n: int) -> None:
            for _ in range(n):
                next(steps)

        return run

    return {
        "decorated": stepper(decorated_steps),
        "undecorated": stepper(plain_steps),
        "floor": step_floor,
    }


def _coroutine_runners(loop: asyncio.AbstractEventLoop) -> dict[str, Runner]:
    async def plain(n: int) -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    decorated = detctx.deterministic(seed=SEED)(plain)
    start_world = _seeded_world()

    async def floor(n: int) -> None:
        outside = raw_capture()
        raw_restore(start_world)
        for _ in range(n):
            inside = raw_capture()
            raw_restore(outside)
            await asyncio.sleep(0)
            outside = raw_capture()
            raw_restore(inside)
        raw_restore(outside)

    def driver(coroutine_function: Callable[[int], Any]) -> Runner:
        def run(n: int) -> None:
            loop.run_until_complete(coroutine_function(n))

        return run

    return {"decorated": driver(decorated), "undecorated": driver(plain), "floor": driver(floor)}


def _rows(what: str, unit: str, missing: str | None, stats: dict[str, Any]) -> list[Row]:
    subject = f"decorated {what} {unit}"
    if missing is not None:
        return [
            Row(
                SCENARIO,
                subject,
                None,
                f"floor: undecorated {unit} + 2 captures + 2 restores",
                stats.get("floor"),
                Target("ratio", 1.2),
                note=missing,
            ),
            Row(
                SCENARIO,
                subject,
                None,
                f"undecorated {what} {unit}",
                stats.get("undecorated"),
                note=missing,
            ),
        ]
    return [
        Row(
            SCENARIO,
            subject,
            stats["decorated"],
            f"floor: undecorated {unit} + 2 captures + 2 restores",
            stats["floor"],
            Target("ratio", 1.2),
        ),
        Row(
            SCENARIO,
            subject,
            stats["decorated"],
            f"undecorated {what} {unit}",
            stats["undecorated"],
        ),
    ]


def run(settings: Settings) -> Result:
    rows: list[Row] = []
    with preserved():
        missing = probe_generator()
        runners = _generator_runners()
        if missing is not None:
            del runners["decorated"]
        rows += _rows("generator", "step", missing, measure(runners, settings))

        missing = probe_coroutine()
        loop = asyncio.new_event_loop()
        try:
            runners = _coroutine_runners(loop)
            if missing is not None:
                del runners["decorated"]
            stats = measure(runners, settings)
        finally:
            loop.close()
        rows += _rows("coroutine", "await", missing, stats)
    for row in rows[2:]:
        row.note = (row.note + "; " if row.note else "") + "each await goes through the event loop"
    return Result(rows)
