"""Train a small model with eval passes scoped by detctx, and show that the loss
curve is bit-identical to the same training with no eval pass at all.

    python examples/train_eval.py
"""

from __future__ import annotations

import torch
from torch import nn

import detctx


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))


def evaluate(model: nn.Module) -> float:
    """MC-dropout evaluation on a freshly sampled batch: it consumes randomness."""
    with torch.no_grad():
        model.train()
        return float(model(torch.randn(128, 16)).pow(2).mean())


def train(steps: int, eval_every: int | None, scope_eval: bool) -> list[float]:
    with detctx.deterministic(seed=1234):
        model = make_model()
        optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
        inputs, targets = torch.randn(512, 16), torch.randn(512, 1)
        losses = []
        for step in range(steps):
            model.train()
            batch = torch.randint(0, len(inputs), (32,))
            loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
            if eval_every and (step + 1) % eval_every == 0:
                model.eval()
                if scope_eval:
                    with detctx.deterministic(seed=0):
                        evaluate(model)
                else:
                    evaluate(model)
        return losses


def main() -> int:
    steps = 30
    reference = train(steps, eval_every=None, scope_eval=True)
    scoped = train(steps, eval_every=5, scope_eval=True)
    unscoped = train(steps, eval_every=5, scope_eval=False)
    print(f"{'step':>4}  {'no eval':>12}  {'scoped eval':>12}  {'unscoped eval':>13}")
    for step in range(0, steps, 3):
        mark = "" if unscoped[step] == reference[step] else "  <- differs"
        print(
            f"{step:>4}  {reference[step]:12.8f}  {scoped[step]:12.8f}  "
            f"{unscoped[step]:13.8f}{mark}"
        )
    same = scoped == reference
    first = next((i for i, (a, b) in enumerate(zip(unscoped, reference)) if a != b), None)
    print(f"\nscoped eval passes: loss curve bit-identical to no eval: {same}")
    print(f"unscoped eval passes: first differing step: {first}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
