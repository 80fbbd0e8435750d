"""Timing and result rows shared by every scenario.

Timing is ``timeit``-style: each contender runs in batches long enough to
dwarf the clock's resolution, the garbage collector is off while a batch runs,
and the contenders of one scenario take turns within every repeat (in a
rotating order), so slow drift of the machine hits them all alike.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detctx._environment import env_switches, inductor


@dataclass(frozen=True)
class Settings:
    """How long to measure: ``batch_s`` per batch, ``repeat`` batches per contender."""

    quick: bool
    batch_s: float
    repeat: int

    @classmethod
    def make(cls, quick: bool) -> Settings:
        return cls(quick, 0.002, 5) if quick else cls(quick, 0.02, 15)


@dataclass(frozen=True)
class Stats:
    """Seconds per call over the repeats: median, quartiles, extremes."""

    median: float
    q1: float
    q3: float
    low: float
    high: float
    repeats: int
    per_batch: int

    @classmethod
    def of(cls, samples: list[float], per_batch: int) -> Stats:
        ordered = sorted(samples)
        if len(ordered) >= 2:
            q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        else:
            q1 = q3 = ordered[0]
        return cls(
            statistics.median(ordered), q1, q3, ordered[0], ordered[-1], len(ordered), per_batch
        )


Runner = Callable[[int], object]
"""Runs ``n`` units of the measured work (calls, steps, awaits)."""


def repeated(fn: Callable[[], object]) -> Runner:
    """A runner that calls ``fn`` ``n`` times."""

    def run(n: int) -> None:
        for _ in range(n):
            fn()

    return run


def _calibrate(run: Runner, batch_s: float) -> int:
    # One call first: a one-time cost (torch imports torch._inductor on the first
    # use_deterministic_algorithms call, seconds) must not size the batches.
    run(1)
    n = 1
    while True:
        start = time.perf_counter()
        run(n)
        elapsed = time.perf_counter() - start
        if elapsed >= batch_s / 4 or n >= 1 << 22:
            return max(1, int(n * batch_s / max(elapsed, 1e-9)))
        n *= 4


def measure(contenders: Mapping[str, Runner], settings: Settings) -> dict[str, Stats]:
    """Time every contender in the same process, interleaved, and summarise per unit."""
    names = list(contenders)
    sizes = {name: _calibrate(contenders[name], settings.batch_s) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for repeat in range(settings.repeat):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                n = sizes[name]
                start = time.perf_counter()
                contenders[name](n)
                samples[name].append((time.perf_counter() - start) / n)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: Stats.of(samples[name], sizes[name]) for name in names}


@dataclass(frozen=True)
class Target:
    """``ratio``: detctx / alternative at most ``limit``; ``seconds``: detctx under ``limit``."""

    kind: str
    limit: float

    def describe(self) -> str:
        if self.kind == "ratio":
            return f"<= {self.limit:g}x"
        return f"< {format_seconds(self.limit)}"

    def met(self, value: float, ratio: float | None) -> bool:
        if self.kind == "ratio":
            return ratio is not None and ratio <= self.limit
        return value < self.limit


@dataclass
class Row:
    """One line of the results table: a detctx measurement against one alternative."""

    scenario: str
    subject: str
    value: Stats | None
    against: str | None = None
    baseline: Stats | None = None
    target: Target | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.value is None or self.baseline is None or self.baseline.median <= 0:
            return None
        return self.value.median / self.baseline.median

    @property
    def status(self) -> str:
        if self.value is None:
            return self.note or "not available"
        if self.against is not None and self.baseline is None:
            return self.note or "not installed"
        if self.target is None:
            return ""
        return "met" if self.target.met(self.value.median, self.ratio) else "missed"

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ratio"] = self.ratio
        data["status"] = self.status
        return data


@dataclass
class Table:
    """An extra table a scenario adds below the main one (breakdowns, scans)."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclass
class Result:
    """What one scenario reports: rows of the main table and extra tables."""

    rows: list[Row]
    tables: list[Table] = field(default_factory=list)


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.3g} us"
    return f"{seconds * 1e9:.3g} ns"


def format_stats(stats: Stats | None) -> str:
    if stats is None:
        return "-"
    return (
        f"{format_seconds(stats.median)} [{format_seconds(stats.q1)} - {format_seconds(stats.q3)}]"
    )


@contextmanager
def preserved_process_state() -> Iterator[None]:
    """Put back the RNGs, determinism flags and environment a scenario may leave changed.

    ``seed_all`` and the hand-written alternatives change process-wide state for
    good; a later scenario would otherwise start from a different process.
    """
    rng = (random.getstate(), np.random.get_state(), torch.default_generator.get_state())
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    # The variables a block sets, read from the switch table, and Lightning's.
    watched = (
        *(switch.variable for switch in env_switches()),
        inductor.VARIABLE,
        "PL_GLOBAL_SEED",
        "PL_SEED_WORKERS",
    )
    env = {name: os.environ.get(name) for name in watched}
    try:
        yield
    finally:
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.default_generator.set_state(rng[2])
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2:]
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def in_fresh_interpreter(code: str) -> dict[str, Any]:
    """Run ``code`` in a new Python process (this checkout importable first) and return
    the JSON object its last line of output prints."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def interleaved(contenders: dict[str, Callable[[], object]], repeat: int) -> dict[str, Stats]:
    """Each contender once to warm up, then ``repeat`` rounds in a rotating order."""
    for run in contenders.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            contenders[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: Stats.of(values, 1) for name, values in samples.items()}
