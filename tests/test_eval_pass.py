"""The eval-pass scenario: scoping the eval pass leaves the training curve untouched."""

from __future__ import annotations

import torch
from torch import nn

import detctx


def train(steps: int, eval_every: int | None, scoped: bool = True) -> list[float]:
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    data, target = torch.randn(64, 8), torch.randn(64, 1)
    losses = []
    for step in range(steps):
        model.train()
        index = torch.randint(0, 64, (16,))  # the training stream: batches and dropout
        loss = nn.functional.mse_loss(model(data[index]), target[index])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
        if eval_every and step % eval_every == 0:
            model.eval()
            if scoped:
                with detctx.deterministic(seed=0):
                    evaluate(model)
            else:
                evaluate(model)
    return losses


def evaluate(model: nn.Module) -> float:
    """An eval pass that draws randomness of its own (a sampled subset, MC dropout)."""
    model.train()  # MC dropout
    with torch.no_grad():
        sample = torch.randn(32, 8)
        return float(model(sample).mean())


def test_scoped_eval_passes_leave_the_loss_curve_bit_identical() -> None:
    without_eval = train(40, eval_every=None)
    with_eval = train(40, eval_every=5)
    assert with_eval == without_eval  # float equality: bit for bit


def test_unscoped_eval_passes_change_the_loss_curve() -> None:
    # The control: without the block, the eval pass eats the training RNG stream.
    assert train(40, eval_every=5, scoped=False) != train(40, eval_every=None)


def test_the_scoped_eval_pass_is_itself_reproducible() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    results = []
    for _ in range(3):
        with detctx.deterministic(seed=0):
            results.append(evaluate(model))
        torch.randn(7)  # training moves on between eval passes
    assert results[0] == results[1] == results[2]
