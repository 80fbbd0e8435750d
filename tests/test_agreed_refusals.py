"""Refusals every rank agrees on: a resume or a DCP load refused on one rank is refused on all,
with nothing changed; resume states know their rank; meshes agree over their dim names."""

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

import detctx

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is absent"
)

SEED = 1000
KINDS = ("no loader", "elastic", "resumable")


def torchrun(world: int, out: Path) -> list[dict[str, Any]]:
    """``tests/agreed_ranks.py`` on ``world`` ranks; each rank's results, by rank."""
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={world}", str(TESTS / "agreed_ranks.py"), str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout}\n{proc.stderr}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    pytest.importorskip("torchdata.stateful_dataloader")  # the ranks build resumable loaders
    folder = tmp_path_factory.mktemp("agreed")
    two = torchrun(2, folder / "two")
    return {"two": two, "four": torchrun(4, folder / "four")}


def refused_alike(seen: list[dict[str, Any]], error: str = "CheckpointError") -> str:
    """The one message every rank raised, once each rank's RNGs and loaders are as before."""
    assert [(rank["error"], rank["unchanged"]) for rank in seen] == [(error, True)] * len(seen)
    assert len({rank["message"] for rank in seen}) == 1
    return str(seen[0]["message"])


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_one_ranks_bad_loader_in_a_dcp_load_is_refused_on_every_rank_with_nothing_changed(
    launches: dict[str, list[dict[str, Any]]],
) -> None:
    # Rank 1 built its loader with batch size 8 where 4 was saved; rank 0's is as saved.
    message = refused_alike([rank["bad loader in a DCP load"] for rank in launches["two"]])
    assert "refused on rank 1" in message
    assert "batch_size was 4, is 8 now" in message


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_a_dcp_entry_with_its_ranks_swapped_and_its_digest_recomputed_is_refused(
    launches: dict[str, list[dict[str, Any]]],
) -> None:
    message = refused_alike([rank["swapped DCP entries"] for rank in launches["two"]])
    assert "saved on rank 1 of 2, and this is rank 0 of 2" in message


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_the_natural_dcp_pattern_is_refused_with_the_way_out_named(
    launches: dict[str, list[dict[str, Any]]],
) -> None:
    # dcp.save({"detctx": detctx.resume_state(loader)}): rank 1 gets rank 0's entry back.
    message = refused_alike([rank["natural DCP pattern"] for rank in launches["two"]])
    assert "saved on rank 0 of 2, and this is rank 1 of 2" in message
    assert "detctx.dcp_resume_state(loaders)" in message


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
@pytest.mark.parametrize("kind", KINDS)
def test_rank_0s_resume_state_is_refused_on_rank_1_on_both_ranks(
    launches: dict[str, list[dict[str, Any]]], kind: str
) -> None:
    message = refused_alike([rank["rank 0's state"][kind] for rank in launches["two"]])
    assert "refused on rank 1" in message


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
@pytest.mark.parametrize("kind", KINDS)
def test_rank_0_of_2s_resume_state_is_refused_on_rank_0_of_4(
    launches: dict[str, list[dict[str, Any]]], kind: str
) -> None:
    message = refused_alike([rank["rank 0 of 2's state"][kind] for rank in launches["four"]])
    assert "saved on rank 0 of 2, and this is rank 0 of 4" in message


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_any_rank_takes_another_ranks_state_as_meant_but_a_resumable_loader_still_refuses(
    launches: dict[str, list[dict[str, Any]]],
) -> None:
    seen = [rank["rank 0's state, any_rank=True"] for rank in launches["two"]]
    assert [rank["no loader"]["error"] for rank in seen] == [None, None]
    assert [rank["elastic"]["error"] for rank in seen] == [None, None]
    assert "rank was 0, is 1 now" in refused_alike([rank["resumable"] for rank in seen])


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_meshes_with_other_dim_names_are_refused_on_both_ranks(
    launches: dict[str, list[dict[str, Any]]],
) -> None:
    # Rank 0 passes mesh_dim_names=("dp",), rank 1 ("fsdp",): the same grid.
    if "meshes with other names" not in launches["two"][0]:
        pytest.skip("this torch has no DeviceMesh")
    seen = [rank["meshes with other names"] for rank in launches["two"]]
    assert "disagree on how each rank's seed is derived" in refused_alike(seen, "SeedMismatchError")


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_a_distinct_dim_the_mesh_leaves_out_is_a_dim_of_size_1_as_in_torchtitan(
    launches: dict[str, list[dict[str, Any]]],
) -> None:
    # torchtitan's trainer passes ["pp"] on a mesh without pp when pp=1: its seed is
    # seed + 0 on every rank; with ("pp", "dp_shard") the dp_shard rank times size(pp) = 1.
    if "absent dims" not in launches["two"][0]:
        pytest.skip("this torch has no DeviceMesh")
    seen = [rank["absent dims"] for rank in launches["two"]]
    assert [rank["pp"] for rank in seen] == [[SEED, SEED], [SEED, SEED]]
    assert [rank["pp+dp_shard"] for rank in seen] == [[SEED, SEED], [SEED + 1, SEED + 1]]


def test_a_resume_state_records_its_rank_world_size_and_run() -> None:
    state = detctx.resume_state()
    assert state["version"] == 3
    assert state["where"]["rank"] == 0 and state["where"]["world_size"] == 1
    assert isinstance(state["where"]["run"], str) and state["where"]["run"]
    detctx.resume(state)


@pytest.mark.parametrize(
    ("where", "words"),
    [
        ({"rank": 1, "world_size": 2, "run": "r"}, "saved on rank 1 of 2, and this is rank 0 of 1"),
        ({"rank": 0, "world_size": 4, "run": "r"}, "saved on rank 0 of 4"),
        ({"rank": 2, "world_size": 2, "run": "r"}, "not the rank, world size and run"),
        (None, "not the rank, world size and run"),
    ],
    ids=["another rank", "another world size", "impossible", "none"],
)
def test_another_ranks_state_is_refused_with_nothing_changed(
    where: dict[str, Any] | None, words: str
) -> None:
    from detctx._basics import plain_digest

    state = detctx.resume_state()
    state["where"] = where
    state["digest"] = plain_digest({k: v for k, v in state.items() if k != "digest"})
    before = detctx.capture()
    with pytest.raises(detctx.CheckpointError, match=words):
        detctx.resume(state)
    assert detctx.capture() == before


def test_any_rank_takes_another_ranks_state() -> None:
    from detctx._basics import plain_digest

    torch.manual_seed(3)
    state = detctx.resume_state()
    state["where"] = {"rank": 1, "world_size": 2, "run": "r"}
    state["digest"] = plain_digest({k: v for k, v in state.items() if k != "digest"})
    expected = torch.rand(2)
    detctx.resume(state, any_rank=True)
    assert torch.equal(torch.rand(2), expected)


def test_a_version_2_state_saved_before_states_recorded_their_rank_still_resumes() -> None:
    from detctx._basics import plain_digest

    torch.manual_seed(4)
    state = detctx.resume_state()
    del state["where"]
    state["version"] = 2
    state["digest"] = plain_digest({k: v for k, v in state.items() if k != "digest"})
    expected = torch.rand(2)
    detctx.resume(state)
    assert torch.equal(torch.rand(2), expected)
