"""Gradient accumulation and resume: a checkpoint taken between two micro-batches of one optimiser
step holds half a gradient, which lives in each parameter's ``.grad`` (not in the model's or the
optimiser's ``state_dict``, nor in detctx's resume state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from helpers import NoisyPoints

import detctx

ACCUMULATE = 2  # micro-batches per optimiser step
MICRO_BATCHES = 8
SAVED_AFTER = 3  # micro-batches: in the middle of the second step


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    with detctx.deterministic(seed=0):
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = detctx.elastic_loader(NoisyPoints(), batch_size=4, seed=7)
    return model, optimizer, loader


def micro_batches(loader: Any) -> Any:
    while True:
        yield from loader


def train(path: Path, *, resume: bool = False, with_grads: bool = True) -> list[torch.Tensor]:
    """The recipe of docs/resume.md with accumulation; the final weights."""
    model, optimizer, loader = build()
    with detctx.deterministic(seed=5):
        start = 0
        if resume:
            checkpoint = torch.load(path, weights_only=True)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            start = checkpoint["micro_batch"]
            if with_grads:
                for parameter, grad in zip(model.parameters(), checkpoint["grads"], strict=True):
                    parameter.grad = grad
            detctx.resume(checkpoint["detctx"], loader)
        for index, (points, targets) in zip(range(start, MICRO_BATCHES), micro_batches(loader)):
            loss = torch.nn.functional.mse_loss(model(points), targets)
            (loss / ACCUMULATE).backward()
            if (index + 1) % ACCUMULATE == 0:
                optimizer.step()
                optimizer.zero_grad()
            if not resume and index + 1 == SAVED_AFTER:
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "micro_batch": index + 1,
                        "grads": [parameter.grad for parameter in model.parameters()],
                        "detctx": detctx.resume_state(loader),
                    },
                    path,
                )
    return [parameter.detach().clone() for parameter in model.parameters()]


def test_a_checkpoint_between_micro_batches_resumes_exactly_when_the_grads_are_saved_with_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "checkpoint.pt"
    straight = train(path)

    resumed = train(path, resume=True)
    without_grads = train(path, resume=True, with_grads=False)

    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    # The recipe without them loses the first micro-batch of the step it was saved in.
    assert not all(torch.equal(a, b) for a, b in zip(straight, without_grads, strict=True))
