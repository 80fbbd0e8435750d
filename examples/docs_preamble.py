"""The names the README's and docs' short examples take from your code.

A Python example in README.md or docs/*.md marked ``<!-- example: fragment -->``
uses names it does not define (``model``, ``loader``, ``train``, ...); this is
what they stand for. ``tests/test_doc_examples.py`` runs every such example
after this file, in a fresh namespace, and the complete examples on their own.

Nothing here is seeded: the model, the data and the inputs start from OS
entropy, as they would in a script that seeds nothing. So an example marked
``reproduces`` reproduces only if it creates what it draws from itself, in a
block or after a seed; one that trains the model built here does not.
"""

from __future__ import annotations

import unittest  # noqa: F401  (docs/decorators.md decorates a TestCase)

import torch
import torch.distributed as dist  # noqa: F401  (the distributed examples)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import detctx  # noqa: F401  (every example calls it)


class Model(nn.Module):
    """A body with dropout and a head: the model the examples train and evaluate."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


model = Model()
dataset = ds = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
loader = DataLoader(dataset, batch_size=8, shuffle=True)
x = torch.randn(8, 4)
batch = x
inputs = (x,)
steps = 3
step = 1000  # the step a checkpoint is taken at
prompt = "a prompt"
path = "checkpoint.pt"
tp_rank, pp_rank, dp_rank = 0, 0, 0


def train(model: nn.Module = model, loader: DataLoader = loader) -> None:  # type: ignore[type-arg]
    """One epoch of SGD; prints each step's loss (the curve ``detctx run`` compares).

    The update is written out: building a ``torch.optim`` optimiser imports
    ``torch._dynamo`` (seconds on torch 2.13), which every example would pay.
    """
    for step, (x, y) in enumerate(loader, start=1):
        loss = nn.functional.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= 0.1 * parameter.grad
        print(f"step {step} loss: {loss.item()!r}")


def evaluate(model: nn.Module) -> float:
    """The loss on a random subset of the data: it draws from the RNG streams."""
    subset = torch.randperm(len(dataset))[:8]
    features, targets = dataset[subset]
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(features), targets))


def jitter(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Random noise on the features of a ``(features, targets)`` batch."""
    features, *rest = batch
    return (features + 0.1 * torch.randn_like(features), *rest)


def train_step(batch: torch.Tensor = x) -> torch.Tensor:
    """A forward and backward pass with dropout; returns the loss."""
    loss = model(batch).pow(2).mean()
    loss.backward()  # type: ignore[no-untyped-call]
    return loss


model_step = train_step


def build_my_op(device: str, large: bool) -> object:
    """A ``ProbeOp`` builder: the inputs of the op on ``device``, and a function running it."""
    size = 1024 if large else 64
    source = torch.randn(size, size, device=device)
    index = torch.randint(0, size, (size,), device=device)

    def run() -> torch.Tensor:
        return torch.zeros(size, size, device=device).index_add_(0, index, source)

    return run
