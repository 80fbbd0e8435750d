"""``detctx demo``: the same training twice, bit for bit, and what breaks without detctx.

A small classifier with dropout learns from a shuffled DataLoader with two
workers whose samples are augmented with random noise; every few steps an
eval pass scores a random subset of held-out data. It is trained four times:

- run 1 and run 2: in ``deterministic(seed=1234)``, the loader driven by
  ``loader_generator()`` and ``seed_worker``, the eval pass in its own
  ``deterministic(seed=0)`` block;
- eval unscoped: the same, but the eval pass draws its subset from the
  training RNG stream, so every dropout mask after the first eval changes;
- no seeding: every RNG starts from OS entropy, as in an unseeded script.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Final

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from detctx._basics import same_float
from detctx._blocks import deterministic
from detctx._cli.curves import Curve, Point, compare
from detctx._cli.plotting import plot
from detctx._data import loader_generator, seed_worker
from detctx._state import capture, restore

__all__ = ["main", "train"]

STEPS: Final = 12
EVAL_EVERY: Final = 4
_FEATURES: Final = 8


class NoisyPoints(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed points in two classes; each read adds fresh noise (NumPy and Python ``random``)."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(size)
        self.x = torch.randn(size, _FEATURES, generator=generator)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.from_numpy(np.random.normal(0.0, 0.1, _FEATURES).astype(np.float32))
        scale = 1.0 + 0.05 * random.random()
        return self.x[index] * scale + noise, self.y[index]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(_FEATURES, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))


def _evaluate(model: nn.Module, held_out: NoisyPoints) -> float:
    subset = torch.randperm(len(held_out))[:16]
    model.eval()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(held_out.x[subset]), held_out.y[subset])
    model.train()
    return float(loss)


def train(*, seeded_loader: bool, scoped_eval: bool) -> list[float]:
    """Train for :data:`STEPS` steps under the current RNG state; the training losses."""
    model = _model()
    loader = DataLoader(
        NoisyPoints(8 * STEPS),
        batch_size=8,
        shuffle=True,
        num_workers=2,
        generator=loader_generator() if seeded_loader else None,
        worker_init_fn=seed_worker if seeded_loader else None,
    )
    held_out = NoisyPoints(64)
    losses: list[float] = []
    while len(losses) < STEPS:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            model.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            _sgd_step(model, 0.1)
            losses.append(float(loss.detach()))
            if len(losses) % EVAL_EVERY == 0:
                if scoped_eval:
                    with deterministic(seed=0):
                        _evaluate(model, held_out)
                else:
                    _evaluate(model, held_out)
            if len(losses) == STEPS:
                break
    return losses


def _sgd_step(model: nn.Module, lr: float) -> None:
    """Plain SGD, written out: building a ``torch.optim`` optimiser imports
    ``torch._dynamo``, which costs the demo about a second to start and more to exit
    (torch 2.13: ``python -X importtime -c "import torch;
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)"``)."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.add_(parameter.grad, alpha=-lr)


def _unseeded() -> list[float]:
    saved = capture()
    try:
        random.seed()
        np.random.seed()
        torch.seed()
        return train(seeded_loader=False, scoped_eval=False)
    finally:
        restore(saved)


def _first_divergence(reference: list[float], other: list[float]) -> int | None:
    for step, (a, b) in enumerate(zip(reference, other), start=1):
        if not same_float(a, b):
            return step
    return None


def _cell(reference: float, value: float) -> str:
    return "=" if same_float(reference, value) else str(np.float32(value))


def main(
    out: IO[str] | None = None,
    progress: IO[str] | None = None,
    plot_path: Path | None = None,
    *,
    since: float | None = None,
) -> int:
    """Run the demo (table to ``out``, default stdout; progress to ``progress``, default
    stderr); 0 when the two detctx runs agree bit for bit, 1 otherwise. With
    ``plot_path``, the four loss curves and their differences from run 1 are drawn there
    too (the suffix names the format). The last line says how long it took; with
    ``since`` (a ``time.monotonic()`` reading: when the ``detctx demo`` command
    started), what it took since then, importing torch included."""
    out = sys.stdout if out is None else out
    progress = sys.stderr if progress is None else progress
    started = time.monotonic()
    startup = None if since is None else max(started - since, 0.0)
    scenarios: list[tuple[str, Callable[[], list[float]]]] = [
        ("run 1", lambda: _in_block(scoped_eval=True)),
        ("run 2", lambda: _in_block(scoped_eval=True)),
        ("eval unscoped", lambda: _in_block(scoped_eval=False)),
        ("no seeding", _unseeded),
    ]
    curves: dict[str, list[float]] = {}
    # The model is tiny: one intra-op thread is much faster than several that spin
    # while the loader's worker processes compete for the same cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, scenario in scenarios:
            progress.write(f"training: {name} ...\n")
            progress.flush()
            curves[name] = scenario()
    finally:
        torch.set_num_threads(threads)
    trained = time.monotonic()
    reference = curves["run 1"]
    names = list(curves)
    widths = [max(len(name), 12) for name in names]
    out.write(
        "detctx demo: an MLP with dropout, a shuffled DataLoader (2 workers, noisy samples),\n"
        f"an eval pass on a random subset every {EVAL_EVERY} steps; training loss per step.\n"
        "'=' means bit-identical to run 1.\n\n"
    )
    out.write("step  " + "  ".join(n.ljust(w) for n, w in zip(names, widths)).rstrip() + "\n")
    for index in range(STEPS):
        cells = [str(np.float32(reference[index]))]
        cells += [_cell(reference[index], curves[name][index]) for name in names[1:]]
        out.write(
            f"{index + 1:>4}  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        )
        out.write("\n")
    out.write("\n")
    agree = _first_divergence(reference, curves["run 2"]) is None
    if agree:
        out.write(f"with detctx:   run 1 and run 2 agree bit for bit at all {STEPS} steps.\n")
    else:
        step = _first_divergence(reference, curves["run 2"])
        out.write(f"with detctx:   run 2 DIVERGES from run 1 at step {step} (unexpected).\n")
    out.write(
        _verdict(
            "eval unscoped",
            _first_divergence(reference, curves["eval unscoped"]),
            f"the eval pass after step {EVAL_EVERY} drew its random subset from the training "
            "RNG, so later dropout masks changed; the curve now depends on when you evaluate",
        )
    )
    out.write(
        _verdict(
            "no seeding",
            _first_divergence(reference, curves["no seeding"]),
            "each process starts from a different random state: other weights, other data "
            "order, other noise",
        )
    )
    if plot_path is not None:
        plot(compare([_curve(name, curves[name]) for name in names]), plot_path, "training loss")
        out.write(f"\nplot written to {plot_path}\n")
    drawing = time.monotonic() - trained if plot_path is not None else None
    out.write(f"\n({_timing(startup, time.monotonic() - started, drawing)})\n")
    out.flush()
    return 0 if agree else 1


def _timing(startup: float | None, demo: float, drawing: float | None) -> str:
    """What the user waited for: the whole command when the process start is known."""
    parts = [f"{demo - (drawing or 0.0):.1f} s training four times"]
    if drawing is not None:
        parts.append(f"{drawing:.1f} s drawing the plot")
    if startup is None:
        return f"{demo:.1f} s: " + ", ".join(parts)
    parts.insert(0, f"{startup:.1f} s importing torch and detctx")
    return f"{startup + demo:.1f} s since detctx started: " + ", ".join(parts)


def _curve(name: str, losses: list[float]) -> Curve:
    return Curve(
        name, tuple(Point(loss, repr(loss), step, step) for step, loss in enumerate(losses, 1))
    )


def _in_block(*, scoped_eval: bool) -> list[float]:
    with deterministic(seed=1234):
        return train(seeded_loader=True, scoped_eval=scoped_eval)


def _verdict(name: str, step: int | None, why: str) -> str:
    label = f"{name}:".ljust(15)
    if step is None:
        return f"{label}agrees with run 1 this time.\n"
    return f"{label}diverges at step {step}: {why}.\n"
