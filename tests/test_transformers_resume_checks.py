"""A Trainer resumed on other data is refused, as detctx's own loaders refuse it.

The Trainer skips the batches a checkpoint trained by count: resumed on a dataset of another
length (or with another number of batches an epoch) it would read other samples and call the
run resumed. Under ``DeterministicCallback`` the resume is refused before anything changes,
for the Trainer's own loader and for an elastic loader behind ``get_train_dataloader``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import detctx

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tiny_masked_lm import make_datasets, make_tokenizer, make_trainer  # noqa: E402

from detctx.integrations.transformers import DeterministicCallback  # noqa: E402

pytestmark = pytest.mark.slow


class StepCounter(transformers.TrainerCallback):  # type: ignore[misc]
    """Counts the optimiser steps a run takes."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps += 1


def trainer_over(
    folder: Path, samples: int, *, elastic: bool, batch_size: int = 4
) -> tuple[Any, StepCounter]:
    """The tiny masked LM over ``samples`` of its training sequences, checkpointing every 5
    steps in ``folder``; with ``elastic`` its training loader is an elastic one."""
    folder.mkdir(parents=True, exist_ok=True)
    counter = StepCounter()
    train_set, eval_set = make_datasets()
    trainer = make_trainer(
        make_tokenizer(folder),
        ((train_set * 2)[:samples], eval_set),
        folder,
        evaluate=False,
        callbacks=[DeterministicCallback(resumable=not elastic), counter],
        steps=8,
        save_strategy="steps",
        save_steps=5,
        per_device_train_batch_size=batch_size,
    )
    if elastic:
        trainer.get_train_dataloader = lambda: detctx.elastic_loader(
            trainer.train_dataset,
            batch_size=batch_size,
            seed=trainer.args.seed,
            collate_fn=trainer.data_collator,
        )
    return trainer, counter


@pytest.fixture(scope="module", params=["own loader", "elastic loader"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 8 steps over 32 sequences (8 batches an epoch), with its checkpoint-5."""
    folder = tmp_path_factory.mktemp(request.param.replace(" ", "-"))
    trainer, _ = trainer_over(folder, 32, elastic=request.param == "elastic loader")
    trainer.train()
    return folder


def is_elastic(folder: Path) -> bool:
    return folder.name.startswith("elastic")


@pytest.mark.parametrize(
    ("samples", "batch_size", "refusal"),
    [
        (24, 4, "trained on a dataset of 32 samples; this run's training dataset has 24"),
        (40, 4, "dataset of 32 samples; this run's training dataset has 40"),
        (32, 2, "8 training batches an epoch; this run's training loader has 16"),
    ],
    ids=["fewer samples", "more samples", "another batch size"],
)
def test_a_trainer_resumed_on_a_dataset_of_another_length_is_refused_with_nothing_changed(
    saved: Path, samples: int, batch_size: int, refusal: str
) -> None:
    trainer, counter = trainer_over(
        saved / f"again-{samples}-{batch_size}",
        samples,
        elastic=is_elastic(saved),
        batch_size=batch_size,
    )
    before = detctx.capture()

    with pytest.raises(detctx.CheckpointError, match=refusal) as refused:
        trainer.train(resume_from_checkpoint=str(saved / "checkpoint-5"))

    assert "Resume with" in str(refused.value)
    assert counter.steps == 0
    assert detctx.capture() == before
    assert detctx.open_blocks() == ()


def test_a_trainer_resumed_on_the_same_data_goes_on_to_the_end(saved: Path) -> None:
    trainer, counter = trainer_over(saved / "same", 32, elastic=is_elastic(saved))

    trainer.train(resume_from_checkpoint=str(saved / "checkpoint-5"))

    assert counter.steps == 3
    assert trainer.state.global_step == 8


def test_a_checkpoint_whose_keyed_streams_were_seeded_from_32_bits_is_refused(
    saved: Path,
) -> None:
    # As a detctx before 64-bit sample seeds wrote it: no "keyed_streams" entry.
    old = saved / "old-detctx" / "checkpoint-5"
    shutil.copytree(saved / "checkpoint-5", old, dirs_exist_ok=True)
    state = json.loads((old / "trainer_state.json").read_text())
    saved_callback = state["stateful_callbacks"]["DeterministicCallback"]
    del saved_callback["attributes"]["keyed_streams"]
    (old / "trainer_state.json").write_text(json.dumps(state))
    trainer, counter = trainer_over(saved / "old-detctx", 32, elastic=is_elastic(saved))
    before = detctx.capture()

    with pytest.raises(detctx.CheckpointError, match="keyed streams are version 1"):
        trainer.train(resume_from_checkpoint=str(old))

    assert counter.steps == 0
    assert detctx.capture() == before
