"""A Hugging Face Trainer run that checkpoints in the middle of an epoch and resumes, for the tests.

``python tests/transformers_resume.py WORKERS FOLDER [--resume STEP]``: trains
the tiny masked LM of ``tiny_masked_lm.py`` for 12 steps (8 per epoch),
evaluating every 2 steps and saving a checkpoint every 5, under detctx's
``DeterministicCallback``, with ``WORKERS`` loader workers, in ``FOLDER``;
writes the training losses, evaluation losses and final weights to
``FOLDER/straight.pt`` or, with ``--resume STEP`` (from ``checkpoint-STEP``),
to ``FOLDER/resumed.pt``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import transformers
from tiny_masked_lm import make_datasets, make_tokenizer, make_trainer

from detctx.integrations.transformers import DeterministicCallback


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workers", type=int)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--resume", type=int)
    options = parser.parse_args()
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    trainer = make_trainer(
        make_tokenizer(options.folder),
        make_datasets(),
        options.folder,
        evaluate=True,
        callbacks=[DeterministicCallback(eval_seed=0)],
        steps=12,
        save_strategy="steps",
        save_steps=5,
        dataloader_num_workers=options.workers,
    )
    checkpoint = None
    if options.resume is not None:
        checkpoint = str(options.folder / f"checkpoint-{options.resume}")
    trainer.train(resume_from_checkpoint=checkpoint)
    history = trainer.state.log_history
    result = {
        "train": {entry["step"]: entry["loss"] for entry in history if "loss" in entry},
        "eval": {entry["step"]: entry["eval_loss"] for entry in history if "eval_loss" in entry},
        "weights": [p.detach() for p in trainer.model.parameters()],
    }
    torch.save(result, options.folder / ("straight.pt" if checkpoint is None else "resumed.pt"))


if __name__ == "__main__":
    main()
