"""Lightning's rows of the resume matrix: one process and 2 ``ddp_spawn`` ranks, saved in the
middle of an epoch and resumed in a fresh process, bit for bit or refused with nothing changed.

Each row is two launches of ``tests/lightning_ranks_resume.py`` (the straight runs, then the
resumed ones), every cell a fit in them; a cell is named ``STRATEGY-WORKERS-SAMPLER``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, TESTS

import detctx

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_launch_at_a_time")]

pytest.importorskip("lightning.pytorch")
pytest.importorskip("torchdata.stateful_dataloader")

RUN_TIMEOUT_S = 1200
SAMPLES = 32


def fits(folder: Path, run: str, *cases: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        env.pop(name, None)
    script = str(TESTS / "lightning_ranks_resume.py")
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", script, str(folder), run, *cases],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"the fits failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def ranks(folder: Path, case: str, run: str) -> list[dict[str, Any]]:
    return [torch.load(path) for path in sorted((folder / case).glob(f"{run}-*.pt"))]


def assert_resumed_bit_for_bit(folder: Path, case: str) -> None:
    straight, resumed = ranks(folder, case, "straight"), ranks(folder, case, "resumed")
    assert len(straight) == len(resumed) > 0, case
    for before, after in zip(straight, resumed):
        left = len(after["steps"])
        assert 0 < left < len(before["steps"]), case
        assert after["steps"] == before["steps"][-left:], case
        assert after["val"], case
        assert all(before["val"][step] == after["val"][step] for step in after["val"]), case
        assert all(torch.equal(a, b) for a, b in zip(before["weights"], after["weights"])), case


def assert_refused_with_nothing_changed(folder: Path, case: str, *words: str) -> None:
    refusal = torch.load(folder / case / "refused.pt")
    assert all(word in refusal["refused"] for word in words), refusal["refused"]
    assert refusal["unchanged"], case
    assert not list((folder / case).glob("resumed-*.pt")), case


def assert_shards_disjoint_and_covering(folder: Path, case: str) -> None:
    straight = ranks(folder, case, "straight")
    assert len(straight) == 2
    per_epoch = len(straight[0]["steps"]) // 2
    for epoch in range(2):
        shards = [
            [
                index
                for _, batch in run["steps"][epoch * per_epoch : (epoch + 1) * per_epoch]
                for index in batch
            ]
            for run in straight
        ]
        assert not set(shards[0]) & set(shards[1]), (case, epoch)
        assert sorted(shards[0] + shards[1]) == list(range(SAMPLES)), (case, epoch)


SINGLE = [f"single-{w}-{s}" for w in ("0", "2", "2p") for s in ("shuffle", "distributed")]
SINGLE_USER_SAMPLER = ["single-0-random", "single-2-random", "single-2p-random"]


def test_one_process_fits_resumed_mid_epoch_continue_bit_for_bit_with_every_worker_setting(
    tmp_path: Path,
) -> None:
    # 2 epochs of 8 batches, validation every 3 steps, resumed from step 11 (the third
    # batch of the second epoch, right before a validation the resumed fit skips).
    fits(tmp_path, "straight", *SINGLE)
    fits(tmp_path, "resumed", *SINGLE)
    for case in SINGLE:
        assert_resumed_bit_for_bit(tmp_path, case)


def test_one_process_fits_with_a_users_random_sampler_resume_bit_for_bit(
    tmp_path: Path,
) -> None:
    # A RandomSampler(generator=g) of the user's, with 0, 2 and 2 persistent workers.
    fits(tmp_path, "straight", *SINGLE_USER_SAMPLER)
    fits(tmp_path, "resumed", *SINGLE_USER_SAMPLER)
    for case in SINGLE_USER_SAMPLER:
        assert not (tmp_path / case / "refused.pt").exists(), case
        assert_resumed_bit_for_bit(tmp_path, case)


SPAWN_EXACT = ["spawn-0-distributed", "spawn-2p-distributed", "spawn-2-random"]
SPAWN_REFUSED = "spawn-2-shuffle"
OTHER_WORLD = "single-2-distributed@spawn-2p-distributed"


def test_ddp_spawn_ranks_read_disjoint_covering_shards_and_each_resumes_its_own_state(
    tmp_path: Path,
) -> None:
    # 2 ranks, 4 batches each per epoch, resumed from step 6 (the second batch of the
    # second epoch); then the 2-rank checkpoint resumed by one process.
    fits(tmp_path, "straight", SPAWN_REFUSED, *SPAWN_EXACT)
    fits(tmp_path, "resumed", SPAWN_REFUSED, *SPAWN_EXACT, OTHER_WORLD)

    for case in (SPAWN_REFUSED, *SPAWN_EXACT):
        assert_shards_disjoint_and_covering(tmp_path, case)
    for case in SPAWN_EXACT:
        assert_resumed_bit_for_bit(tmp_path, case)
    assert_refused_with_nothing_changed(tmp_path, SPAWN_REFUSED, "DistributedSamplerWrapper")
    assert_refused_with_nothing_changed(tmp_path, OTHER_WORLD, "world size 2", "resumed by 1")


DDP_EXACT = "ddp-2-distributed"
DDP_REFUSED = "ddp-0-shuffle"


def test_ddp_ranks_relaunched_from_the_script_resume_each_its_own_state(tmp_path: Path) -> None:
    # strategy="ddp" runs the script again for rank 1 (one fit per launch): the same hooks
    # as ddp_spawn, the ranks started otherwise; each rank's loader and RNG states travel
    # in the checkpoint and come back on that rank.
    for case in (DDP_EXACT, DDP_REFUSED):
        fits(tmp_path, "straight", case)
        fits(tmp_path, "resumed", case)
        assert_shards_disjoint_and_covering(tmp_path, case)
    assert_resumed_bit_for_bit(tmp_path, DDP_EXACT)
    assert_refused_with_nothing_changed(tmp_path, DDP_REFUSED, "DistributedSamplerWrapper")
    rank_1 = torch.load(tmp_path / DDP_REFUSED / "refused-1.pt")
    assert "DistributedSamplerWrapper" in rank_1["refused"] and rank_1["unchanged"]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_distributed_samplers_epoch_travels_with_the_loader_state() -> None:
    # Lightning makes the resumed loader's iterator before it calls set_epoch, and
    # torchdata replays the sampler's order right there.
    def loader() -> Any:
        points = list(range(12))
        sampler = torch.utils.data.DistributedSampler(points, num_replicas=1, rank=0, seed=3)
        return detctx.resumable_loader(points, batch_size=2, sampler=sampler)

    straight = loader()
    straight.sampler.set_epoch(1)
    iterator = iter(straight)
    next(iterator)
    state = straight.state_dict()
    rest = [batch.tolist() for batch in iterator]

    resumed = loader()
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in resumed] == rest
    assert state["epoch"] == 1 and resumed.sampler.epoch == 1

    # A crafted epoch, or an epoch for a loader whose sampler has none, changes nothing.
    shuffled = detctx.resumable_loader(list(range(12)), batch_size=2, shuffle=True)
    for target, crafted in ((loader(), {**state, "epoch": "1"}), (shuffled, state)):
        with pytest.raises(detctx.CheckpointError, match=r"epoch|sampler"):
            target.load_state_dict(crafted)
        assert target.next_iter_state is None
