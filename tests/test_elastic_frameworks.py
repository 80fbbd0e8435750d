"""Elastic resume in Lightning and the Hugging Face Trainer: a checkpoint saved with 2 loader
workers continues bit for bit with none, in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TESTS

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 300


def fit(framework: str, folder: Path, run: str, workers: int) -> dict[str, object]:
    """``tests/elastic_frameworks.py`` in a fresh process; what it saved."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), OMP_NUM_THREADS="1")
    script = str(TESTS / "elastic_frameworks.py")
    proc = subprocess.run(
        [sys.executable, script, framework, str(folder), run, str(workers)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
    )
    assert proc.returncode == 0, f"{framework} {run} failed:\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, object] = torch.load(folder / f"{run}-{workers}.pt")
    return result


def same_weights(a: object, b: object) -> bool:
    assert isinstance(a, list) and isinstance(b, list)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_lightning_fit_saved_with_two_workers_resumes_bit_for_bit_with_none(
    tmp_path: Path,
) -> None:
    pytest.importorskip("lightning")
    # 3 epochs of 5 batches; the checkpoint of step 6 is the second batch of the second
    # epoch. Augmentation draws from torch, NumPy and Python; the model has dropout.
    straight = fit("lightning", tmp_path, "straight", 2)
    resumed = fit("lightning", tmp_path, "resumed", 0)
    assert isinstance(straight["losses"], list) and len(straight["losses"]) == 15
    assert resumed["losses"] == straight["losses"][6:]
    assert same_weights(resumed["weights"], straight["weights"])


def test_a_trainer_saved_with_two_workers_resumes_bit_for_bit_with_none(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    # Each sequence has a token replaced at random when read, and the masked-LM collator
    # draws its masks, each in its keyed streams;
    # checkpoint-10 is the second batch of the second epoch. The resumed run's history
    # starts with the checkpoint's (steps 1 to 10).
    straight = fit("transformers", tmp_path, "straight", 2)
    resumed = fit("transformers", tmp_path, "resumed", 0)
    assert isinstance(straight["losses"], dict) and sorted(straight["losses"]) == list(range(1, 13))
    assert resumed["losses"] == straight["losses"]
    assert same_weights(resumed["weights"], straight["weights"])
