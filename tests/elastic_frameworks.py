"""Lightning and Hugging Face Trainer fits over an elastic loader, for the elastic resume tests.

``python tests/elastic_frameworks.py FRAMEWORK FOLDER RUN WORKERS``: ``FRAMEWORK`` is
``lightning`` or ``transformers``, ``RUN`` ``straight`` or ``resumed``. Each writes the
training losses and the final weights to ``FOLDER/RUN-WORKERS.pt``; a straight run saves
checkpoints in ``FOLDER``, and a resumed run starts from the one in the middle of the
second epoch, with its own ``WORKERS``.

- ``lightning``: 3 epochs of 5 batches of 4 (``NoisyPoints``: torch, NumPy and Python
  augmentation), dropout in the model, under ``DeterministicCallback``, a checkpoint every
  3 steps; the resume starts from step 6.
- ``transformers``: the tiny masked LM of ``tiny_masked_lm.py`` (its collator masks at
  random, and a token of each sequence is replaced at random when read) for 12 steps of 8
  per epoch, a checkpoint every 5 steps; the resume starts from
  ``checkpoint-10``. The Trainer's training loader is replaced by an elastic one.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch
from helpers import NoisyPoints

import detctx


def lightning(folder: Path, run: str, workers: int) -> dict[str, Any]:
    from lightning_fit import framework
    from lightning_resume import Model as ResumedModel

    from detctx.integrations.lightning import DeterministicCallback

    pl = framework()

    class Model(ResumedModel):  # type: ignore[misc, valid-type]
        """The resume tests' model (dropout), reading an elastic loader (no validation here)."""

        def train_dataloader(self) -> Any:
            return detctx.elastic_loader(
                NoisyPoints(), batch_size=4, seed=3, num_workers=self.workers
            )

    with detctx.deterministic(seed=0):
        model = Model(workers)
    saver = pl.callbacks.ModelCheckpoint(
        dirpath=folder, filename="{step}", every_n_train_steps=3, save_top_k=-1
    )
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[DeterministicCallback(seed=7), saver],
    )
    checkpoint = str(folder / "step=6.ckpt") if run == "resumed" else None
    trainer.fit(model, ckpt_path=checkpoint)
    return {"losses": model.losses, "weights": [p.detach() for p in model.parameters()]}


def transformers_fit(folder: Path, run: str, workers: int) -> dict[str, Any]:
    import transformers
    from tiny_masked_lm import make_datasets, make_tokenizer, make_trainer

    from detctx.integrations.transformers import DeterministicCallback

    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    trainer = make_trainer(
        make_tokenizer(folder),
        make_datasets(),
        folder,
        evaluate=False,
        # The elastic loader keys the collator's masks itself.
        callbacks=[DeterministicCallback(eval_seed=0, resumable=False)],
        steps=12,
        save_strategy="steps",
        save_steps=5,
    )

    class Substituted(torch.utils.data.Dataset[dict[str, list[int]]]):
        """The training sequences, one token replaced at random when read (torch draws)."""

        def __init__(self, sequences: list[dict[str, list[int]]]) -> None:
            self.sequences = sequences

        def __len__(self) -> int:
            return len(self.sequences)

        def __getitem__(self, index: int) -> dict[str, list[int]]:
            ids = list(self.sequences[index]["input_ids"])
            ids[int(torch.randint(1, len(ids) - 1, ()))] = int(torch.randint(5, 32, ()))
            return {"input_ids": ids}

    def elastic_train_loader() -> Any:
        return detctx.elastic_loader(
            Substituted(trainer.train_dataset),
            batch_size=trainer.args.per_device_train_batch_size,
            seed=trainer.args.seed,
            collate_fn=trainer.data_collator,
            num_workers=workers,
        )

    trainer.get_train_dataloader = elastic_train_loader
    checkpoint = str(folder / "checkpoint-10") if run == "resumed" else None
    trainer.train(resume_from_checkpoint=checkpoint)
    history = trainer.state.log_history
    return {
        "losses": {entry["step"]: entry["loss"] for entry in history if "loss" in entry},
        "weights": [p.detach() for p in trainer.model.parameters()],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["lightning", "transformers"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("run", choices=["straight", "resumed"])
    parser.add_argument("workers", type=int)
    options = parser.parse_args()
    options.folder.mkdir(parents=True, exist_ok=True)
    fit = lightning if options.framework == "lightning" else transformers_fit
    result = fit(options.folder, options.run, options.workers)
    torch.save(result, options.folder / f"{options.run}-{options.workers}.pt")


if __name__ == "__main__":
    main()
