"""Elastic resume across world sizes: 2 ranks -> 1 and 1 -> 2, under torchrun on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, TESTS

pytestmark = [
    pytest.mark.usefixtures("one_launch_at_a_time"),
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is absent"),
]

STEPS = 8
SAVE_AT = 4  # the second step of the second epoch (3 steps of 6 samples per epoch)


def torchrun(world: int, out: Path, *options: str) -> dict[str, Any]:
    """``tests/elastic_ranks.py`` on ``world`` ranks; what rank 0 wrote."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]),
        OMP_NUM_THREADS="1",
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={world}", str(TESTS / "elastic_ranks.py"), str(out)]
    proc = subprocess.run(
        [*command, str(STEPS), *options], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def samples(result: dict[str, Any]) -> list[tuple[int, list[Any]]]:
    return [(step["epoch"], step["samples"]) for step in result["steps"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("elastic_ranks")
    two = torchrun(2, folder / "two", "--save-at", str(SAVE_AT))
    one = torchrun(1, folder / "one", "--save-at", str(SAVE_AT))
    return {
        "two": two,
        "one": one,
        "two then one": torchrun(1, folder / "two_one", "--resume", str(folder / "two.ckpt")),
        "one then two": torchrun(2, folder / "one_two", "--resume", str(folder / "one.ckpt")),
    }


@pytest.mark.parametrize(
    ("straight", "resumed"), [("two", "two then one"), ("one", "one then two")]
)
def test_the_global_sample_sequence_after_a_resume_on_another_world_size_is_the_straight_one(
    runs: dict[str, dict[str, Any]], straight: str, resumed: str
) -> None:
    # Each sample as loaded (its index and the digest of its augmented bytes), the ranks'
    # parts of each step in rank order, across the boundaries of epochs 1 and 2.
    assert [step["step"] for step in runs[resumed]["steps"]] == list(range(SAVE_AT, STEPS))
    assert [epoch for epoch, _ in samples(runs[resumed])] == [1, 1, 2, 2]
    assert samples(runs[resumed]) == samples(runs[straight])[SAVE_AT:]


def test_one_rank_and_two_load_the_same_global_sequence(runs: dict[str, dict[str, Any]]) -> None:
    assert samples(runs["one"]) == samples(runs["two"])


def test_the_losses_of_a_resume_on_another_world_size_agree_to_float32_rounding(
    runs: dict[str, dict[str, Any]],
) -> None:
    # The global batch of each step is the same, but its loss is one mean over 6 samples
    # on one rank and the mean of two means over 3 on two, and the gradient is averaged
    # by an all-reduce: the same sum in another order. Measured here (docs/resume.md,
    # "Elastic resume"): they differ in the last bits of float32, not beyond.
    for straight, resumed in (("two", "two then one"), ("one", "one then two")):
        expected = [step["loss"] for step in runs[straight]["steps"][SAVE_AT:]]
        got = [step["loss"] for step in runs[resumed]["steps"]]
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
        for a, b in zip(runs[straight]["weights"], runs[resumed]["weights"]):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
