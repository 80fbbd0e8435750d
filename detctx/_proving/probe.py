"""Which ops are nondeterministic here: run each op of a catalogue with determinism off and on.

:func:`run_probe` runs every op of :data:`~detctx._proving.probe_catalogue.PROBE_OPS` (or
the ops given) on each device type, ``runs`` times with deterministic
algorithms off and ``runs`` times with them on, and reports per op and device
whether the results were bit-identical each way, whether the op raises under
``torch.use_deterministic_algorithms(True)``, and how much slower it is with
determinism on. Each half runs inside a ``detctx.deterministic`` block, so the
process's RNGs, flags and variables are as they were afterwards.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from detctx._basics import DeterminismWarning, as_integer
from detctx._blocks import deterministic
from detctx._proving.probe_catalogue import PROBE_OPS, ProbeOp
from detctx._sources import active_accelerators, device_module
from detctx._state import canonical_bytes

__all__ = ["PROBE_OPS", "ProbeOp", "ProbeReport", "ProbeRow", "probe_devices", "run_probe"]


@dataclass(frozen=True)
class ProbeRow:
    """One op on one device.

    ``identical_off`` / ``identical_on``: every run gave the same bits with
    deterministic algorithms off / on (``None`` where it could not run that
    way). ``raises``: it raised under ``use_deterministic_algorithms(True)``
    (``detail`` has the first line). ``slowdown``: fastest time on / fastest
    time off. ``error``: it failed even with determinism off.
    """

    op: str
    device: str
    identical_off: bool | None
    identical_on: bool | None
    raises: bool
    slowdown: float | None
    detail: str | None = None
    error: str | None = None


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
    are wall-clock ratios of the fastest of a few runs: a rough guide, not a benchmark::

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
    with deterministic(seed, algorithms=False, cudnn=False, cublas_workspace=False):
        if torch.are_deterministic_algorithms_enabled():
            torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        try:
            off = _repeat(op.build(device, large), runs, device)
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
        try:
            on = _repeat(op.build(device, large), runs, device)
        except RuntimeError as exc:
            return ProbeRow(
                op.name,
                device.type,
                identical_off=off[0],
                identical_on=None,
                raises=True,
                slowdown=None,
                detail=_first_line(exc),
            )
    slowdown = on[1] / off[1] if off[1] > 0 else None
    return ProbeRow(
        op.name,
        device.type,
        identical_off=off[0],
        identical_on=on[0],
        raises=False,
        slowdown=slowdown,
    )


def _repeat(thunk: Any, runs: int, device: torch.device) -> tuple[bool, float]:
    """Run ``thunk`` once to warm up, then ``runs`` times: (all bit-identical, fastest s)."""
    synchronize = getattr(device_module(device.type), "synchronize", None)
    thunk()
    results, times = [], []
    for _ in range(runs):
        if synchronize is not None:
            synchronize()
        start = time.perf_counter()
        out = thunk()
        if synchronize is not None:
            synchronize()
        times.append(time.perf_counter() - start)
        results.append(_bits(out))
    # The fastest run: the least disturbed by other work on a shared machine.
    return all(result == results[0] for result in results), min(times)


def _bits(out: Any) -> bytes:
    return canonical_bytes(out)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
