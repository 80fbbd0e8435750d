"""A tiny Lightning fit for the integration tests, importable by spawned and fresh processes.

``python tests/lightning_fit.py OUT.json [options]`` runs one fit and writes
its loss curve and final weights to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import random
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

SEED = 7


def framework(name: str = "lightning.pytorch") -> Any:
    for logger in ("lightning", "lightning.pytorch", "pytorch_lightning", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning|pytorch_lightning")
    warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
    return importlib.import_module(name)


class ModelBody:
    """Dropout in training; with ``random_val``, validation adds random noise."""

    def __init__(
        self,
        random_val: bool = True,
        record_to: str | None = None,
        workers: int = 0,
        val_generator: bool = False,
    ) -> None:
        super().__init__()
        self.workers = workers
        self.val_generator = val_generator
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
        )
        self.random_val = random_val
        self.record_to = record_to
        self.losses: list[float] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        if self.random_val:
            x = x + torch.randn_like(x) * random.random()
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss)  # type: ignore[attr-defined]
        return loss

    def test_step(self, batch: Any, index: int) -> torch.Tensor:
        return self.validation_step(batch, index)

    def predict_step(self, batch: Any, index: int) -> torch.Tensor:
        x, _ = batch
        return self.net(x + torch.randn_like(x))  # type: ignore[no-any-return]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)  # type: ignore[attr-defined]

    # Built in the process that fits (ddp_spawn cannot send a DataLoader's
    # torch.Generator to its children through shared memory here).
    def train_dataloader(self) -> DataLoader[Any]:
        return loaders(self.workers, self.val_generator)[0]

    def val_dataloader(self) -> DataLoader[Any]:
        return loaders(self.workers, self.val_generator)[1]

    def on_fit_end(self) -> None:
        if self.record_to is not None:
            rank = self.global_rank  # type: ignore[attr-defined]
            (Path(self.record_to) / f"losses-{rank}.json").write_text(json.dumps(self.losses))


class Model(ModelBody, framework().LightningModule):  # type: ignore[misc]
    """The model for ``lightning.pytorch`` (a module-level class: ddp_spawn pickles it)."""


def model_class(name: str = "lightning.pytorch") -> Any:
    if name == "lightning.pytorch":
        return Model
    return type("Model", (ModelBody, framework(name).LightningModule), {})


def build_model(name: str = "lightning.pytorch", **kwargs: Any) -> Any:
    """The model with the same initial weights every time (built under its own seed)."""
    # The CPU generator alone: torch.manual_seed would also seed every accelerator, which
    # fork_rng(devices=[]) does not put back (a warm CUDA device would keep seed 0).
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)
        return model_class(name)(**kwargs)


def loaders(workers: int, val_generator: bool = False) -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    val = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
    return (
        DataLoader(train, batch_size=4, shuffle=True, num_workers=workers),
        DataLoader(
            val,
            batch_size=4,
            num_workers=workers,
            # Its own generator: then creating its iterator draws nothing from torch's.
            generator=torch.Generator().manual_seed(1) if val_generator else None,
        ),
    )


def trainer(name: str = "lightning.pytorch", **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "devices": 1,
    }
    options.update(kwargs)
    return framework(name).Trainer(**options)


def weights(model: Any) -> list[float]:
    return [x for p in model.state_dict().values() for x in p.flatten().tolist()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--reference", action="store_true", help="seed_everything + deterministic")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    parser.add_argument("--random-val", action="store_true")
    parser.add_argument("--record-to", default=None)
    args = parser.parse_args()

    from detctx.integrations.lightning import DeterministicCallback

    model = build_model(
        random_val=args.random_val, record_to=args.record_to, val_generator=not args.random_val
    )
    if args.reference:
        framework().seed_everything(SEED)
        fit_trainer = trainer(deterministic=True, strategy=args.strategy, devices=args.devices)
    else:
        fit_trainer = trainer(
            callbacks=[DeterministicCallback(seed=SEED)],
            strategy=args.strategy,
            devices=args.devices,
        )
    fit_trainer.fit(model, ckpt_path=args.resume)
    Path(args.out).write_text(json.dumps({"losses": model.losses, "weights": weights(model)}))


if __name__ == "__main__":
    main()
