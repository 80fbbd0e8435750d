"""Scenario 7: a training step of the demo model while every op is recorded for locating.

``locate_divergence`` and ``detctx run --locate`` record each ATen op of a
step (forward, backward, optimiser): name, module path, source line and a
digest of its outputs. The target: a recorded step of the demo model
(``detctx demo``'s MLP with dropout, batch of 8, cross-entropy, SGD) costs at
most 3x the unrecorded step. Recording writes to a trace file, as
``detctx run --locate`` does. Both contenders run with one intra-op thread,
as the demo does.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from benchmarks.baselines import SEED
from benchmarks.harness import Result, Row, Runner, Settings, Target, measure
from benchmarks.harness import preserved_process_state as preserved

SCENARIO = "7 locate"
FEATURES = 8


def demo_model() -> nn.Module:
    """The architecture ``detctx demo`` trains (``detctx/cli/demo.py``)."""
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))


def _step_runner(model: nn.Module) -> Runner:
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(8, FEATURES, generator=generator)
    y = torch.randint(0, 2, (8,), generator=generator)

    def run(n: int) -> None:
        for _ in range(n):
            loss = nn.functional.cross_entropy(model(x), y)
            optimiser.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimiser.step()

    return run


def run(settings: Settings) -> Result:
    try:
        from detctx.locate.recorder import OpRecorder
        from detctx.locate.trace import TraceWriter
    except ImportError as exc:
        return Result([Row(SCENARIO, "recorded training step", None, note=f"not available: {exc}")])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with preserved(), tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(SEED)
        plain = _step_runner(demo_model())
        recorded_step = _step_runner(demo_model())
        writer = TraceWriter(Path(folder) / "bench.trace")
        recorder = OpRecorder(writer)

        def recorded(n: int) -> None:
            recorder.start()
            try:
                recorded_step(n)
            finally:
                recorder.stop()

        try:
            stats = measure({"recorded": recorded, "plain": plain}, settings)
        finally:
            writer.close()
            torch.set_num_threads(threads)
    return Result(
        [
            Row(
                SCENARIO,
                "recorded training step (demo MLP, batch 8, SGD)",
                stats["recorded"],
                "the same step, unrecorded",
                stats["plain"],
                Target("ratio", 3.0),
                note=f"{writer.count} ops recorded in all",
            )
        ]
    )
