"""The resume matrix: an own loop and torchrun DDP with 2 gloo ranks, with 0 workers, 2 workers and
2 persistent workers, under each sampler recipe, saved in the middle of an epoch and resumed in a
fresh process: bit for bit (losses, sample indices, final weights)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, TESTS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_launch_at_a_time")]

pytest.importorskip("torchdata.stateful_dataloader")

RUN_TIMEOUT_S = 600
WORKERS = {"0": "0 workers", "2": "2 workers", "2p": "2 persistent workers"}
OWN_LOOP = [f"{sampler}-{workers}" for sampler in ("shuffle", "random") for workers in WORKERS]
DDP = [
    f"{sampler}-{workers}"
    for sampler in ("shuffle", "distributed", "random")
    for workers in WORKERS
]


def launch(directory: Path, world: int, phase: str, cells: list[str]) -> None:
    """``tests/resume_loop.py`` in a fresh process (under torchrun for 2 ranks)."""
    script = [str(TESTS / "resume_loop.py"), str(directory), phase, *cells]
    command = [sys.executable, *script]
    if world > 1:
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *(f"--nproc-per-node={world}", *script),
        ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    env.update(OMP_NUM_THREADS="1")
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, f"the loop failed:\n{proc.stdout}\n{proc.stderr}"


def run_matrix(directory: Path, world: int, cells: list[str]) -> Path:
    launch(directory, world, "straight", cells)  # checkpoints after step 5, trains on
    launch(directory, world, "resumed", cells)  # a new process: from step 5's checkpoint
    return directory


@pytest.fixture(scope="module")
def own_loop(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_matrix(tmp_path_factory.mktemp("own-loop"), 1, OWN_LOOP)


@pytest.fixture(scope="module")
def torchrun_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is absent")
    return run_matrix(tmp_path_factory.mktemp("torchrun-ddp"), 2, DDP)


def results(directory: Path, cell: str, rank: int) -> tuple[Any, Any]:
    straight, resumed = (
        torch.load(directory / f"{run}.{cell}.rank{rank}") for run in ("straight", "resumed")
    )
    return straight, resumed


def assert_continues_bit_for_bit(straight: Any, resumed: Any) -> None:
    assert len(resumed["losses"]) == 6
    assert resumed["losses"] == straight["losses"][5:]
    assert resumed["indices"] == straight["indices"][5:]
    assert all(torch.equal(a, b) for a, b in zip(straight["weights"], resumed["weights"]))


@pytest.mark.parametrize("cell", OWN_LOOP)
def test_an_own_loop_resumed_in_a_fresh_process_continues_bit_for_bit(
    own_loop: Path, cell: str
) -> None:
    # Step 5 is the second batch of the second epoch; the resumed run crosses two
    # epoch boundaries. Augmentation draws from torch, NumPy and Python in the workers.
    assert_continues_bit_for_bit(*results(own_loop, cell, 0))


@pytest.mark.parametrize("cell", DDP)
def test_torchrun_ddp_ranks_resumed_in_fresh_processes_continue_bit_for_bit(
    torchrun_ddp: Path, cell: str
) -> None:
    ranks = [results(torchrun_ddp, cell, rank) for rank in (0, 1)]
    for straight, resumed in ranks:
        assert_continues_bit_for_bit(straight, resumed)
    (first, _), (second, _) = ranks
    assert first["losses"] != second["losses"]  # each rank has its own data and streams


@pytest.mark.parametrize("cell", DDP)
def test_rank_1_resuming_from_rank_0s_checkpoint_is_refused_with_nothing_changed(
    torchrun_ddp: Path, cell: str
) -> None:
    # Both ranks resume rank 0's file (a collective): rank 1 refuses, so both are refused.
    seen = [results(torchrun_ddp, cell, rank)[1]["other_rank"] for rank in (0, 1)]
    assert seen[0] == seen[1]
    assert "refused on rank 1" in seen[1]
    assert "saved on rank 0 of 2, and this is rank 1 of 2" in seen[1]
    assert "Resume each rank from the state it saved" in seen[1]


@pytest.mark.parametrize("sampler", ["shuffle", "distributed", "random"])
@pytest.mark.parametrize("workers", list(WORKERS))
def test_two_ranks_read_disjoint_shards_that_cover_every_sample_in_each_epoch(
    torchrun_ddp: Path, sampler: str, workers: str
) -> None:
    # Epochs 0 and 1 (steps 0 to 7) of the straight run, and of the run stopped after
    # step 5 and resumed: its steps 0 to 4, then the resumed process's.
    cell = f"{sampler}-{workers}"
    straight = [results(torchrun_ddp, cell, rank)[0] for rank in (0, 1)]
    stitched = [
        run["indices"][:5] + results(torchrun_ddp, cell, rank)[1]["indices"]
        for rank, run in enumerate(straight)
    ]
    per_epoch = straight[0]["batches_per_epoch"]
    for indices in ([run["indices"] for run in straight], stitched):
        for epoch in (0, 1):
            shards = [
                [
                    index
                    for batch in rank[epoch * per_epoch : (epoch + 1) * per_epoch]
                    for index in batch
                ]
                for rank in indices
            ]
            assert sorted(shards[0] + shards[1]) == list(range(20))
            assert not set(shards[0]) & set(shards[1])
