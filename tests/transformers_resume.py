"""Hugging Face Trainer runs that checkpoint in the middle of an epoch and resume, for the tests.

``python tests/transformers_resume.py FOLDER RUN WORKERS...``, ``RUN`` being
``straight`` or ``resumed``: for each ``WORKERS`` (``0``, ``2``, or ``2p`` for 2
persistent workers), trains the tiny masked LM of ``tiny_masked_lm.py`` for
20 steps (8 per epoch), evaluating every 2 steps and saving a checkpoint
every 5, under detctx's ``DeterministicCallback``, in ``FOLDER/WORKERS``, and
writes the training losses and evaluation losses (by step), the final
weights and the number of steps trained in this process to
``FOLDER/WORKERS/RUN.pt``. The resumed run starts from ``checkpoint-10``, in
the middle of the second epoch, and crosses the boundary into the third.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import transformers
from tiny_masked_lm import make_datasets, make_tokenizer, make_trainer

from detctx.integrations.transformers import DeterministicCallback

RESUME_AT = 10
STEPS = 20


class StepCounter(transformers.TrainerCallback):  # type: ignore[misc]
    """Counts the optimiser steps this process runs."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
        self.steps += 1


def train(folder: Path, workers: str, resume: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    counter = StepCounter()
    trainer = make_trainer(
        make_tokenizer(folder),
        make_datasets(),
        folder,
        evaluate=True,
        callbacks=[DeterministicCallback(eval_seed=0), counter],
        steps=STEPS,
        save_strategy="steps",
        save_steps=5,
        dataloader_num_workers=int(workers.rstrip("p")),
        dataloader_persistent_workers=workers.endswith("p"),
    )
    checkpoint = str(folder / f"checkpoint-{RESUME_AT}") if resume else None
    trainer.train(resume_from_checkpoint=checkpoint)
    history = trainer.state.log_history
    result = {
        "train": {entry["step"]: entry["loss"] for entry in history if "loss" in entry},
        "eval": {entry["step"]: entry["eval_loss"] for entry in history if "eval_loss" in entry},
        "weights": [p.detach() for p in trainer.model.parameters()],
        "steps_here": counter.steps,
    }
    torch.save(result, folder / ("resumed.pt" if resume else "straight.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("run", choices=["straight", "resumed"])
    parser.add_argument("workers", choices=["0", "2", "2p"], nargs="+")
    options = parser.parse_args()
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    for workers in options.workers:
        train(options.folder / workers, workers, options.run == "resumed")


if __name__ == "__main__":
    main()
