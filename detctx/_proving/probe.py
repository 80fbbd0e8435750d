"""Which ops are nondeterministic here: run each op of a catalogue with determinism off and on.

:func:`run_probe` runs every op of :data:`~detctx._proving.probe_catalogue.PROBE_OPS` (or
the ops given) on each device type, ``runs`` times with deterministic
algorithms off and ``runs`` times with them on, and reports per op and device
whether the results were bit-identical each way, whether the op raises under
``torch.use_deterministic_algorithms(True)``, and how much slower it is with
determinism on. Each half runs inside a ``detctx.deterministic`` block, so the
process's RNGs, flags and variables are as they were afterwards.

The slowdown is timed in pairs: the same inputs with the flags off, then on,
back to back, each timing a batch of calls that lasts at least
:data:`SAMPLE_SECONDS` (CPU time of the process on the CPU, the wall clock
around a synchronize on an accelerator); the median ratio of
:data:`TIMED_ROUNDS` pairs. Timing
all the "off" runs and then all the "on" runs, as this once did, let a busy
moment on a shared machine land on one side only: histc on a 2-core machine
read 0.001x, then 0.48x, then 0.93x.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import torch

from detctx._basics import DeterminismWarning, as_integer
from detctx._blocks import deterministic
from detctx._proving.probe_catalogue import PROBE_OPS, ProbeOp
from detctx._sources import active_accelerators, device_module
from detctx._state import canonical_bytes

__all__ = [
    "PROBE_OPS",
    "SAMPLE_SECONDS",
    "TIMED_ROUNDS",
    "ProbeOp",
    "ProbeReport",
    "ProbeRow",
    "paired_ratios",
    "paired_slowdown",
    "probe_devices",
    "ratio_interval",
    "run_probe",
]

TIMED_ROUNDS: Final = 9
"""Pairs of timings (off, then on) behind each slowdown; the median ratio is reported."""

SAMPLE_SECONDS: Final = 0.005
"""The least a timing lasts: a fast op is called as many times as that takes (at most
:data:`_MAX_CALLS`), so the clock's resolution and one scheduler tick do not decide it."""

_MAX_CALLS: Final = 1000


@dataclass(frozen=True)
class ProbeRow:
    """One op on one device.

    ``identical_off`` / ``identical_on``: every run gave the same bits with
    deterministic algorithms off / on (``None`` where it could not run that
    way). ``raises``: it raised under ``use_deterministic_algorithms(True)``
    (``detail`` has the first line). ``slowdown``: time on / time off, the
    median of :data:`TIMED_ROUNDS` pairs timed back to back
    (:func:`paired_slowdown`); ``slowdown_range``: the spread of those pairs around it
    (:func:`ratio_interval`). ``error``: it failed even with determinism off.
    """

    op: str
    device: str
    identical_off: bool | None
    identical_on: bool | None
    raises: bool
    slowdown: float | None
    detail: str | None = None
    error: str | None = None
    slowdown_range: tuple[float, float] | None = None

    @property
    def measurable(self) -> bool:
        """Whether the slowdown stands out of the noise: its pairs' interval leaves out 1."""
        low, high = self.slowdown_range or (1.0, 1.0)
        return not low <= 1.0 <= high


@dataclass
class ProbeReport:
    """The rows, the number of runs each way, and notes (warnings met on the way)."""

    runs: int
    rows: list[ProbeRow]
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def nondeterministic(self) -> list[ProbeRow]:
        """The rows whose runs differed with determinism off or on."""
        return [row for row in self.rows if False in (row.identical_off, row.identical_on)]


def probe_devices() -> list[str]:
    """The device types a probe can run on here: ``cpu`` and every available accelerator."""
    return ["cpu", *(accelerator.device_type for accelerator in active_accelerators())]


def run_probe(
    device_types: Sequence[str] | None = None,
    *,
    ops: Sequence[ProbeOp] | None = None,
    runs: int = 5,
    seed: int = 0,
) -> ProbeReport:
    """Run each op ``runs`` times with determinism off and on, on each device type.

    ``device_types``: ``"cpu"`` and the available accelerator types (default:
    all of them; each is probed on its device 0). ``ops``: default
    :data:`PROBE_OPS`. Bad arguments raise ``ValueError`` / ``TypeError``
    before anything runs. Nothing is left changed: each half runs in a
    ``deterministic(seed)`` block (off: ``algorithms=False, cudnn=False,
    cublas_workspace=False`` and torch's flag switched off inside). Slowdowns
    are medians of wall-clock ratios timed in pairs (see :func:`paired_slowdown`):
    a guide, not a benchmark::

        report = detctx.run_probe(["cuda"])
        for row in report.nondeterministic():
            print(row.op, row.device)
    """
    count = as_integer(runs)
    if count is None or count < 2:
        raise ValueError(f"runs must be an integer of at least 2 to compare anything, got {runs!r}")
    runs = count
    available = probe_devices()
    chosen = list(available if device_types is None else device_types)
    unknown = [name for name in chosen if name not in available]
    if unknown:
        raise ValueError(
            f"cannot probe device type {unknown[0]!r} here; available: {', '.join(available)}"
        )
    catalogue = list(PROBE_OPS if ops is None else ops)
    for op in catalogue:
        if not isinstance(op, ProbeOp):
            raise TypeError(f"ops must be detctx.ProbeOp objects, got {type(op).__name__}")
    rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in chosen:
            device = torch.device(name if name == "cpu" else f"{name}:0")
            rows += [_probe_op(op, device, runs, seed) for op in catalogue if op.applies(device)]
    notes = list(
        dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, DeterminismWarning))
    )
    return ProbeReport(runs, rows, notes)


def _probe_op(op: ProbeOp, device: torch.device, runs: int, seed: int) -> ProbeRow:
    large = device.type != "cpu"
    synchronize = getattr(device_module(device.type), "synchronize", None)
    with deterministic(seed, algorithms=False, cudnn=False, cublas_workspace=False):
        _switch(on=False)
        try:
            identical_off = _repeat(op.build(device, large), runs, synchronize)
        except Exception as exc:
            return ProbeRow(
                op.name,
                device.type,
                identical_off=None,
                identical_on=None,
                raises=False,
                slowdown=None,
                error=_first_line(exc),
            )
    with deterministic(seed):
        thunk = op.build(device, large)
        try:
            identical_on = _repeat(thunk, runs, synchronize)
        except RuntimeError as exc:
            return ProbeRow(
                op.name,
                device.type,
                identical_off=identical_off,
                identical_on=None,
                raises=True,
                slowdown=None,
                detail=_first_line(exc),
            )
        # Inside the block: the flags it set are put back on exit, whatever _switch left.
        # On the CPU, the process's CPU time: other processes on a shared machine take
        # turns on the cores, and wall-clock batches that lost their turn read 25x or
        # 0.02x on a CPU where nothing changes (detctx doctor --probe beside a test run
        # on 2 cores). A device's time is the wall clock around a synchronize.
        clock = time.process_time if device.type == "cpu" else time.perf_counter
        ratios = paired_ratios(thunk, lambda on: _switch(on=on), synchronize, clock=clock)
    return ProbeRow(
        op.name,
        device.type,
        identical_off=identical_off,
        identical_on=identical_on,
        raises=False,
        slowdown=statistics.median(ratios) if ratios else None,
        slowdown_range=ratio_interval(ratios),
    )


def _switch(*, on: bool) -> None:
    if torch.are_deterministic_algorithms_enabled() != on:
        torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on


def _repeat(thunk: Any, runs: int, synchronize: Callable[[], None] | None) -> bool:
    """Run ``thunk`` once to warm up, then ``runs`` times: whether all gave the same bits."""
    thunk()
    results = []
    for _ in range(runs):
        out = thunk()
        if synchronize is not None:
            synchronize()
        results.append(_bits(out))
    return all(result == results[0] for result in results)


def paired_slowdown(
    thunk: Callable[[], object],
    switch: Callable[[bool], None],
    synchronize: Callable[[], None] | None = None,
    *,
    rounds: int = TIMED_ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> float | None:
    """How much slower ``thunk`` runs with ``switch(True)`` than with ``switch(False)``: the
    median of :func:`paired_ratios` (``None`` when the clock saw no time pass)."""
    ratios = paired_ratios(thunk, switch, synchronize, rounds=rounds, clock=clock)
    return statistics.median(ratios) if ratios else None


def paired_ratios(
    thunk: Callable[[], object],
    switch: Callable[[bool], None],
    synchronize: Callable[[], None] | None = None,
    *,
    rounds: int = TIMED_ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Time on / time off of ``thunk``, one ratio a round, smallest first.

    Each of ``rounds`` rounds times a batch of calls off, then the same batch on,
    back to back, so a busy moment falls on both sides of a pair or on one pair
    only. The batch is as many calls as last :data:`SAMPLE_SECONDS` (one call at
    least, :data:`_MAX_CALLS` at most); a round whose "off" batch saw no time pass
    gives no ratio.
    """

    def timed(*, on: bool, calls: int) -> float:
        switch(on)
        if synchronize is not None:
            synchronize()
        start = clock()
        for _ in range(calls):
            thunk()
        if synchronize is not None:
            synchronize()
        return clock() - start

    once = timed(on=False, calls=1)
    calls = _MAX_CALLS if once <= 0 else min(_MAX_CALLS, max(1, math.ceil(SAMPLE_SECONDS / once)))
    ratios = []
    for _ in range(rounds):
        off, on = timed(on=False, calls=calls), timed(on=True, calls=calls)
        if off > 0:
            ratios.append(on / off)
    return sorted(ratios)


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float] | None:
    """Where the median of ``ratios`` lies, judged from their own spread: the order
    statistics around it that hold the true median at least 95% of the time (the 2nd
    smallest and the 2nd largest of 9), or the smallest and largest of fewer than 6.

    It assumes nothing about how the timings scatter, so a probe on a loaded machine
    gets a wide interval and a quiet one a narrow one; ``None`` without ratios.
    """
    ordered = sorted(ratios)
    count = len(ordered)
    if not count:
        return None
    # The largest k whose tail P(Binomial(count, 1/2) < k) stays within 2.5%, at least 1.
    k, tail = 1, 1 / 2**count
    while k < count and tail + math.comb(count, k) / 2**count <= 0.025:
        tail += math.comb(count, k) / 2**count
        k += 1
    return ordered[k - 1], ordered[count - k]


def _bits(out: Any) -> bytes:
    return canonical_bytes(out)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
