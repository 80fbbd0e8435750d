"""Hugging Face Trainer runs that checkpoint in the middle of an epoch and resume, for the tests.

``python tests/transformers_resume.py FOLDER RUN WORKERS...``, ``RUN`` being
``straight`` or ``resumed``: for each ``WORKERS`` (``0``, ``2``, or ``2p`` for 2
persistent workers), trains the tiny masked LM of ``tiny_masked_lm.py`` for
20 steps (8 per epoch), evaluating every 2 steps and saving a checkpoint
every 5, under detctx's ``DeterministicCallback``, in ``FOLDER/WORKERS``, and
writes the training losses and evaluation losses (by step), the final
weights and the number of steps trained in this process to
``FOLDER/WORKERS/RUN-RANK.pt``. The resumed run starts from ``checkpoint-10``,
in the middle of the second epoch (of the third with 2 processes), and
crosses an epoch boundary; ``WORKERS@SAVED_BY`` resumes from the checkpoint
of the ``SAVED_BY`` folder (another world size, say). A resume that raises
(a refusal) writes ``FOLDER/WORKERS/refused-RANK.pt``: the message, and
whether every RNG is as before ``train()``. Run under ``torchrun`` (or with
``RANK``, ``WORLD_SIZE`` and a rendezvous in the environment), each process
trains its rank.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import transformers
from tiny_masked_lm import make_datasets, make_tokenizer, make_trainer

import detctx
from detctx.integrations.transformers import DeterministicCallback

RESUME_AT = 10
STEPS = 20


class StepCounter(transformers.TrainerCallback):  # type: ignore[misc]
    """Counts the optimiser steps this process runs."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
        self.steps += 1


def train(folder: Path, case: str, resume: bool) -> None:
    workers, _, saved_by = case.partition("@")
    rank = int(os.environ.get("RANK", "0"))
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
    source = folder.parent / saved_by if saved_by else folder
    checkpoint = str(source / f"checkpoint-{RESUME_AT}") if resume else None
    before = detctx.capture()
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    except detctx.CheckpointError as exc:
        unchanged = detctx.capture() == before and detctx.open_blocks() == ()
        torch.save({"refused": str(exc), "unchanged": unchanged}, folder / f"refused-{rank}.pt")
        return
    history = trainer.state.log_history
    result = {
        "train": {entry["step"]: entry["loss"] for entry in history if "loss" in entry},
        "eval": {entry["step"]: entry["eval_loss"] for entry in history if "eval_loss" in entry},
        "weights": [p.detach() for p in trainer.model.parameters()],
        "steps_here": counter.steps,
    }
    torch.save(result, folder / f"{'resumed' if resume else 'straight'}-{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("run", choices=["straight", "resumed"])
    parser.add_argument("cases", nargs="+", help="WORKERS (0, 2, 2p) or WORKERS@SAVED_BY")
    options = parser.parse_args()
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    for case in options.cases:
        train(options.folder / case, case, options.run == "resumed")


if __name__ == "__main__":
    main()
