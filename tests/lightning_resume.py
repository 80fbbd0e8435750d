"""A Lightning fit that checkpoints in the middle of an epoch and resumes, for the resume tests.

``python tests/lightning_resume.py WORKERS MODE OUT [--resume STEP]``: fits 3
epochs of 5 batches (a resumable loader over a dataset with random
augmentation, dropout in the model, a validation that draws) under
``DeterministicCallback`` and writes the training losses and final weights
to ``OUT``. ``MODE`` is where checkpoints are saved, in ``OUT``'s folder:
``steps`` every 3 training steps (``ModelCheckpoint(every_n_train_steps=3)``),
``validation`` at the end of each validation, which runs after the third
batch of every epoch. ``--resume STEP`` resumes from the checkpoint saved at
global step ``STEP``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning_fit import framework

import detctx
from detctx.integrations.lightning import DeterministicCallback

pl = framework()


class NoisyPoints(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """20 points; every read adds torch, NumPy and Python noise."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(20, 4, generator=generator)
        self.y = torch.randn(20, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.1 * torch.randn(4) + float(np.random.normal()) * 0.01 + random.random() * 0.01
        return self.x[index] + noise, self.y[index]


class Model(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
        )
        self.losses: list[float] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x + torch.randn_like(x)), y)
        self.log("val_loss", loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return detctx.resumable_loader(
            NoisyPoints(), batch_size=4, shuffle=True, num_workers=self.workers
        )

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(NoisyPoints(), batch_size=10)


def fit(workers: int, mode: str, out: Path, resume: int | None) -> None:
    folder = out.parent
    if mode == "steps":
        saver = pl.callbacks.ModelCheckpoint(
            dirpath=folder, filename="{step}", every_n_train_steps=3, save_top_k=-1
        )
        schedule: dict[str, Any] = {"limit_val_batches": 0}
    else:
        saver = pl.callbacks.ModelCheckpoint(
            dirpath=folder, filename="{step}", monitor="val_loss", save_top_k=-1,
            save_on_train_epoch_end=False,
        )
        schedule = {"val_check_interval": 3, "num_sanity_val_steps": 0}
    with detctx.deterministic(seed=0):
        model = Model(workers)
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[DeterministicCallback(seed=7), saver],
        **schedule,
    )
    checkpoint = None if resume is None else str(folder / f"step={resume}.ckpt")
    trainer.fit(model, ckpt_path=checkpoint)
    torch.save(
        {"losses": model.losses, "weights": [p.detach() for p in model.parameters()]}, out
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workers", type=int)
    parser.add_argument("mode", choices=["steps", "validation"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--resume", type=int)
    options = parser.parse_args()
    fit(options.workers, options.mode, options.out, options.resume)


if __name__ == "__main__":
    main()
