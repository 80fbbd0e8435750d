"""Resume anywhere in Lightning and the Hugging Face Trainer: mid-epoch checkpoints continue bit
for bit in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TESTS

pytest.importorskip("torchdata.stateful_dataloader")

RUN_TIMEOUT_S = 300


def run_script(script: str, *arguments: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(TESTS / script), *arguments],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.slow
def test_lightning_fits_resumed_from_a_mid_epoch_or_a_validation_checkpoint_continue_bit_for_bit(
    tmp_path: Path,
) -> None:
    pytest.importorskip("lightning")
    # ModelCheckpoint(every_n_train_steps=3) at step 6, with 0 and 2 loader workers,
    # and a checkpoint saved at the end of the validation that runs after the third
    # batch of each epoch (step 8): both in the middle of the second of 3 epochs. And
    # one saved in on_validation_end after the first epoch (step 5), which Lightning
    # records as not yet past the epoch's end.
    cases = ["steps-0", "steps-2", "validation-0", "epoch_validation-2"]
    run_script("lightning_resume.py", str(tmp_path), "straight", *cases)
    run_script("lightning_resume.py", str(tmp_path), "resumed", *cases)
    for case, steps_left in zip(cases, [9, 9, 7, 10]):
        straight = torch.load(tmp_path / case / "straight.pt")
        resumed = torch.load(tmp_path / case / "resumed.pt")
        assert len(straight["losses"]) == 15, case
        assert resumed["losses"] == straight["losses"][-steps_left:], case
        assert all(torch.equal(a, b) for a, b in zip(straight["weights"], resumed["weights"])), case


@pytest.mark.slow
def test_a_trainer_resumed_from_a_mid_epoch_save_steps_checkpoint_continues_bit_for_bit(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    # The masked-LM collator draws its masks at random, evaluation runs every 2 steps,
    # checkpoint-10 is the second batch of the second epoch, and the resumed run crosses
    # into the third at step 16; 0, 2 and 2 persistent loader workers.
    run_script("transformers_resume.py", str(tmp_path), "straight", "0", "2", "2p")
    run_script("transformers_resume.py", str(tmp_path), "resumed", "0", "2", "2p")
    for workers in ("0", "2", "2p"):
        straight = torch.load(tmp_path / workers / "straight-0.pt")
        resumed = torch.load(tmp_path / workers / "resumed-0.pt")
        assert sorted(straight["train"]) == list(range(1, 21))
        assert sorted(resumed["eval"]) == list(range(2, 21, 2))
        assert (straight["steps_here"], resumed["steps_here"]) == (20, 10)
        # The resumed run's history starts with the checkpoint's (steps 1 to 10).
        assert resumed["train"] == straight["train"], workers
        assert resumed["eval"] == straight["eval"], workers
        assert all(torch.equal(a, b) for a, b in zip(straight["weights"], resumed["weights"]))
