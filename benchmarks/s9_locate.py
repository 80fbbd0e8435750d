"""Scenario 7: a training step of the demo model while every op is recorded for locating.

``locate_divergence`` and ``detctx run --locate`` record each ATen op of a
step (forward, backward, optimiser): name, module path, source line and a
digest of its outputs, written to a trace file. The target: a recorded
training step of ``detctx demo`` (its MLP with dropout, a batch of 8 from
its shuffled DataLoader with 2 workers and noisy samples, cross-entropy,
SGD) costs at most 3x the unrecorded step. A second row times the model
part alone (a fixed batch, no loader), where the per-op cost shows most.
Both run with one intra-op thread, as the demo does.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.baselines import SEED
from benchmarks.harness import Result, Row, Runner, Settings, Stats, Target, measure
from benchmarks.harness import preserved_process_state as preserved

SCENARIO = "9 locate"
FEATURES = 8
BATCH = 8


def demo_model() -> nn.Module:
    """The architecture ``detctx demo`` trains (``detctx/_cli/demo.py``)."""
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))


def _step_runner(
    model: nn.Module, batches: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> Runner:
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)

    def run(n: int) -> None:
        for _ in range(n):
            x, y = batches()
            loss = nn.functional.cross_entropy(model(x), y)
            optimiser.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimiser.step()

    return run


def _fixed_batch() -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    y = torch.randint(0, 2, (BATCH,), generator=generator)
    return lambda: (x, y)


def _demo_batches(loaders: list[Any]) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    from detctx._cli.demo import NoisyPoints
    from detctx._data.loader import loader_generator, seed_worker

    loader = DataLoader(
        NoisyPoints(BATCH * 64),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        generator=loader_generator(SEED),
        worker_init_fn=seed_worker,
    )
    loaders.append(loader)
    current: list[Iterator[Any]] = [iter(loader)]

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        try:
            x, y = next(current[0])
        except StopIteration:
            current[0] = iter(loader)
            x, y = next(current[0])
        return x, y

    return next_batch


def _pair(
    settings: Settings, folder: Path, batches: Callable[[], Callable[[], Any]]
) -> tuple[dict[str, Stats], int]:
    from detctx._locate.recorder import OpRecorder
    from detctx._locate.trace import TraceWriter

    torch.manual_seed(SEED)
    plain = _step_runner(demo_model(), batches())
    recorded_step = _step_runner(demo_model(), batches())
    writer = TraceWriter(folder / "bench.trace")
    recorder = OpRecorder(writer)

    def recorded(n: int) -> None:
        recorder.start()
        try:
            recorded_step(n)
        finally:
            recorder.stop()

    try:
        return measure({"recorded": recorded, "plain": plain}, settings), writer.count
    finally:
        writer.close()


def run(settings: Settings) -> Result:
    try:
        import detctx._locate.recorder  # noqa: F401
    except ImportError as exc:
        return Result(
            [Row(SCENARIO, "recorded demo training step", None, note=f"not available: {exc}")]
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaders: list[Any] = []
    try:
        with preserved(), tempfile.TemporaryDirectory() as folder:
            demo, demo_ops = _pair(settings, Path(folder), lambda: _demo_batches(loaders))
            model, model_ops = _pair(settings, Path(folder), _fixed_batch)
    finally:
        loaders.clear()
        torch.set_num_threads(threads)
    return Result(
        [
            Row(
                SCENARIO,
                "recorded demo training step (loader, MLP, SGD)",
                demo["recorded"],
                "the same step, unrecorded",
                demo["plain"],
                Target("ratio", 3.0),
                note=f"{demo_ops} ops recorded",
            ),
            Row(
                SCENARIO,
                "recorded model step alone (fixed batch)",
                model["recorded"],
                "the same step, unrecorded",
                model["plain"],
                note=f"{model_ops} ops recorded; the per-op cost of recording",
            ),
        ]
    )
