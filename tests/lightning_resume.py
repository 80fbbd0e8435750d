"""Lightning fits that checkpoint in the middle of an epoch and resume, for the resume tests.

``python tests/lightning_resume.py FOLDER RUN CASE...``, ``RUN`` being
``straight`` or ``resumed``, ``CASE`` being ``MODE-WORKERS``: fits 3 epochs
of 5 batches (a resumable loader over a dataset with random augmentation,
dropout in the model, a validation that draws) under
``DeterministicCallback``, in ``FOLDER/CASE``, and writes the training losses
and final weights to ``FOLDER/CASE/RUN.pt``. ``MODE`` is where checkpoints
are saved: ``steps`` every 3 training steps
(``ModelCheckpoint(every_n_train_steps=3)``), ``validation`` at the end of
each validation, which runs after the third batch of every epoch,
``epoch_validation`` at the end of each validation, which runs at the end of
every epoch. The resumed run starts from the checkpoint of step 6
(``steps``) or 8 (``validation``), in the middle of the second epoch, or 5
(``epoch_validation``), saved in ``on_validation_end`` after the first.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from helpers import NoisyPoints
from lightning_fit import framework

import detctx
from detctx.integrations.lightning import DeterministicCallback

pl = framework()


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


RESUME_AT = {"steps": 6, "validation": 8, "epoch_validation": 5}


def fit(workers: int, mode: str, folder: Path, resume: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if mode == "steps":
        saver = pl.callbacks.ModelCheckpoint(
            dirpath=folder, filename="{step}", every_n_train_steps=3, save_top_k=-1
        )
        schedule: dict[str, Any] = {"limit_val_batches": 0}
    else:
        saver = pl.callbacks.ModelCheckpoint(
            dirpath=folder,
            filename="{step}",
            monitor="val_loss",
            save_top_k=-1,
            save_on_train_epoch_end=False,
        )
        schedule = {"num_sanity_val_steps": 0}
        if mode == "validation":
            schedule["val_check_interval"] = 3
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
    checkpoint = str(folder / f"step={RESUME_AT[mode]}.ckpt") if resume else None
    trainer.fit(model, ckpt_path=checkpoint)
    result = {"losses": model.losses, "weights": [p.detach() for p in model.parameters()]}
    torch.save(result, folder / ("resumed.pt" if resume else "straight.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("run", choices=["straight", "resumed"])
    parser.add_argument("cases", nargs="+")
    options = parser.parse_args()
    for case in options.cases:
        mode, workers = case.split("-")
        fit(int(workers), mode, options.folder / case, options.run == "resumed")


if __name__ == "__main__":
    main()
