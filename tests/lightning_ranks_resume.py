"""Lightning fits, in one process or on 2 ``ddp_spawn`` ranks, saved mid-epoch and resumed.

``python tests/lightning_ranks_resume.py FOLDER RUN CASE...``, ``RUN`` being
``straight`` or ``resumed``, ``CASE`` being ``STRATEGY-WORKERS-SAMPLER``:

- ``STRATEGY``: ``single`` (one process), ``spawn`` (``strategy="ddp_spawn"``,
  2 CPU ranks, gloo) or ``ddp`` (``strategy="ddp"``: Lightning runs this script
  again for rank 1, so a launch takes one ``ddp`` case);
- ``WORKERS``: ``0``, ``2`` or ``2p`` (2 persistent workers);
- ``SAMPLER``: ``shuffle`` (the recipe: ``resumable_loader(dataset,
  shuffle=True)``), ``distributed`` (a ``DistributedSampler`` the module
  builds) or ``random`` (a ``RandomSampler`` with its own generator);
- ``@SAVED_BY`` (optional, resumed runs): resume from the checkpoint of the
  case ``SAVED_BY`` (another world size, say).

Each fit trains 2 epochs over :data:`SAMPLES` augmented samples (dropout,
validation with random noise every 3 steps) under ``DeterministicCallback``,
saving a checkpoint after every step in ``FOLDER/CASE``. The resumed run
starts from the checkpoint of :data:`RESUME_AT`, in the middle of the second
epoch; a fit that raises (a refusal) writes ``FOLDER/CASE/refused.pt``: the
message, and whether every RNG is as before the fit. Each rank writes
``FOLDER/CASE/RUN-RANK.pt``: per training step the loss and the sample
indices of its batch, the validation losses by step and the final weights.
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

SAMPLES = 32
BATCH = 4
RESUME_AT = {"single": 11, "spawn": 6, "ddp": 6}
"""The third batch of the second epoch (8 per epoch), or the second (4 per epoch per rank)."""


class IndexedPoints(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Points with torch, NumPy and Python noise added on every read, and their index."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 4, generator=generator)
        self.y = torch.randn(count, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        noise = 0.1 * torch.randn(4) + float(np.random.normal()) * 0.01 + random.random() * 0.01
        return self.x[index] + noise, self.y[index], index


class Model(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, case: str, out: str, run: str) -> None:
        super().__init__()
        _, self.workers, self.sampler = case.split("-")
        self.out, self.run = out, run
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
        )
        self.steps: list[tuple[float, list[int]]] = []
        self.val_losses: dict[int, list[float]] = {}

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y, indices = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.steps.append((loss.item(), indices.tolist()))
        return loss

    def validation_step(self, batch: Any, index: int) -> None:
        x, y, _ = batch
        loss = torch.nn.functional.mse_loss(self.net(x + torch.randn_like(x)), y)
        self.val_losses.setdefault(self.global_step, []).append(loss.item())

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        dataset = IndexedPoints(SAMPLES)
        workers = {"0": 0, "2": 2, "2p": 2}[self.workers]
        options: dict[str, Any] = {
            "batch_size": BATCH,
            "num_workers": workers,
            "persistent_workers": self.workers == "2p",
        }
        if self.sampler == "shuffle":
            options["shuffle"] = True
        elif self.sampler == "distributed":
            options["sampler"] = torch.utils.data.DistributedSampler(
                dataset, num_replicas=self.trainer.world_size, rank=self.global_rank, seed=3
            )
        else:
            generator = torch.Generator().manual_seed(5)
            options["sampler"] = torch.utils.data.RandomSampler(dataset, generator=generator)
        return detctx.resumable_loader(dataset, **options)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(IndexedPoints(8), batch_size=4)

    def on_fit_end(self) -> None:
        result = {
            "steps": self.steps,
            "val": self.val_losses,
            "weights": [p.detach().clone() for p in self.parameters()],
        }
        torch.save(result, Path(self.out) / f"{self.run}-{self.global_rank}.pt")


def fit(case: str, folder: Path, run: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    case, _, saved_by = case.partition("@")
    strategy = case.split("-")[0]
    saver = pl.callbacks.ModelCheckpoint(
        dirpath=folder, filename="{step}", every_n_train_steps=RESUME_AT[strategy], save_top_k=-1
    )
    with detctx.deterministic(seed=0):
        model = Model(case, str(folder), run)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1 if strategy == "single" else 2,
        strategy={"single": "auto", "spawn": "ddp_spawn", "ddp": "ddp"}[strategy],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=3,
        callbacks=[DeterministicCallback(seed=7), saver],
    )
    checkpoint = None
    if run == "resumed":
        source = folder.parent / saved_by if saved_by else folder
        checkpoint = str(source / f"step={RESUME_AT[(saved_by or case).split('-')[0]]}.ckpt")
    before = detctx.capture()
    try:
        trainer.fit(model, ckpt_path=checkpoint)
    except Exception as exc:  # a refusal: in a ddp_spawn rank, re-raised here by the launcher
        unchanged = detctx.capture() == before and detctx.open_blocks() == ()
        name = "refused.pt" if trainer.global_rank == 0 else f"refused-{trainer.global_rank}.pt"
        torch.save({"refused": str(exc), "unchanged": unchanged}, folder / name)
    finally:
        # Lightning's ddp leaves its process group up; gloo's threads still running when
        # the interpreter exits abort it ("terminate called without an active exception").
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("run", choices=["straight", "resumed"])
    parser.add_argument("cases", nargs="+")
    options = parser.parse_args()
    for case in options.cases:
        fit(case, options.folder / case, options.run)


if __name__ == "__main__":
    main()
