"""FSDP2 and DCP checkpoints: each rank resumes its own state; elastic loaders on any world size."""

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
from helpers import IndexedPoints
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx
from detctx._data import dcp_state

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is absent"
)

STEPS = 6
SAVE_AT = 3


def torchrun(world: int, out: Path, *options: str) -> list[dict[str, Any]]:
    """``tests/fsdp_ranks.py`` on ``world`` ranks; each rank's results, by rank."""
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={world}", str(TESTS / "fsdp_ranks.py"), str(out)]
    proc = subprocess.run(
        [*command, str(STEPS), *options], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout}\n{proc.stderr}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("fsdp_dcp")
    save, save_async = str(folder / "checkpoint"), str(folder / "checkpoint_async")
    return {
        "straight": torchrun(
            2,
            folder / "straight",
            *("--save-at", str(SAVE_AT), save),
            *("--show-dedup", str(folder / "dedup")),
        ),
        "again, saved with async_save": torchrun(
            2, folder / "again", "--save-at", str(SAVE_AT), save_async, "--async-save"
        ),
        "resumed": torchrun(2, folder / "resumed", "--resume", save),
        "resumed from async_save": torchrun(2, folder / "resumed_async", "--resume", save_async),
        "resumed on 1 rank": torchrun(1, folder / "one", "--resume", save),
    }


def losses(result: dict[str, Any]) -> list[float]:
    return [step["loss"] for step in result["steps"]]


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_dcp_keeps_one_ranks_copy_of_a_key_every_rank_saves_so_resume_state_needs_its_own_form(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    # docs/mesh.md: {"pos": 100 + rank, "t": tensor([rank, rank])} saved on 2 ranks and loaded
    # in place gives both ranks pos 100 and t [1, 1]; the plain resume_state dict does not
    # give rank 1 its own RNG streams back (dcp_resume_state does: the tests below).
    seen = [result["dedup"] for result in runs["straight"]]
    assert [(rank["pos"], rank["t"]) for rank in seen] == [(100, [1, 1]), (100, [1, 1])]
    assert seen[1]["resume_state"] != "own state back"


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_fsdp2_with_dropout_and_an_elastic_loader_trains_bit_identically_across_launches(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    first, second = runs["straight"], runs["again, saved with async_save"]
    for rank in (0, 1):
        assert losses(first[rank]) == losses(second[rank])
        assert len(losses(first[rank])) == STEPS
    assert first[0]["weights"] == second[0]["weights"]
    # Each dp rank draws its own dropout masks and samples: the ranks' losses differ.
    assert losses(first[0]) != losses(first[1])


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
@pytest.mark.parametrize("resumed", ["resumed", "resumed from async_save"])
def test_a_dcp_resume_at_step_3_of_6_is_exact_on_every_rank(
    runs: dict[str, list[dict[str, Any]]], resumed: str
) -> None:
    straight = runs["straight"]
    for rank in (0, 1):
        assert [step["step"] for step in runs[resumed][rank]["steps"]] == [3, 4, 5]
        assert losses(runs[resumed][rank]) == losses(straight[rank])[SAVE_AT:]
        assert runs[resumed][rank]["steps"] == straight[rank]["steps"][SAVE_AT:]
    assert runs[resumed][0]["weights"] == straight[0]["weights"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_saved_on_2_ranks_and_resumed_on_1_the_global_sample_order_is_the_straight_runs(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    straight = runs["straight"]
    expected = [
        straight[0]["steps"][step]["samples"] + straight[1]["steps"][step]["samples"]
        for step in range(SAVE_AT, STEPS)
    ]
    assert [step["samples"] for step in runs["resumed on 1 rank"][0]["steps"]] == expected


def loader(seed: int = 7, batch_size: int = 2) -> detctx.ElasticLoader:
    return detctx.elastic_loader(IndexedPoints(), batch_size=batch_size, seed=seed)


def take(count: int, elastic: detctx.ElasticLoader) -> None:
    batches = iter(elastic)
    for _ in range(count):
        next(batches)


@settings(max_examples=15, deadline=None)
@given(before=st.integers(0, 4), after=st.integers(0, 4), draws=st.integers(0, 3))
def test_whatever_happened_after_saving_loading_puts_rngs_and_position_back(
    before: int, after: int, draws: int
) -> None:
    elastic = loader()
    take(before, elastic)
    saved = detctx.dcp_resume_state(elastic).state_dict()
    expected = (detctx.capture(), elastic.epoch, elastic.consumed)
    take(after, elastic)
    torch.rand(draws)
    detctx.dcp_resume_state(elastic).load_state_dict(saved)
    assert (detctx.capture(), elastic.epoch, elastic.consumed) == expected


def damaged(saved: dict[str, bytes]) -> dict[str, bytes]:
    blob = bytearray(saved["ranks"])
    blob[-10] ^= 0xFF
    return {"ranks": bytes(blob)}


def with_payload(**changes: Any) -> dict[str, bytes]:
    """A well-formed entry, as another run or layout would have saved it."""
    payload = dcp_state._to_bytes(
        {
            "format": dcp_state.DCP_FORMAT,
            "version": 1,
            "world_size": 1,
            "ranks": [dcp_state._to_bytes(detctx.resume_state(loader()))],
            "elastic": [loader().state_dict()],
            **changes,
        }
    )
    return {"ranks": dcp_state._MAGIC + dcp_state._digest(payload) + payload}


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda saved: damaged(saved), "damaged"),
        (lambda saved: {"ranks": b"something else"}, "not what detctx.dcp_resume_state saves"),
        (lambda saved: {"pos": 100}, "not what detctx.dcp_resume_state saves"),
        (lambda saved: with_payload(format="other"), "not a detctx DCP resume state"),
        (lambda saved: with_payload(version=99), "newer detctx"),
        (lambda saved: with_payload(ranks=[]), "no resume state for each of its ranks"),
        (lambda saved: with_payload(elastic=[]), "0 loader state"),
    ],
    ids=[
        "damaged",
        "bytes of something else",
        "another entry",
        "format",
        "version",
        "ranks",
        "loaders",
    ],
)
def test_a_damaged_or_foreign_entry_is_refused_with_nothing_changed(make: Any, words: str) -> None:
    elastic = loader()
    take(2, elastic)
    entry = make(detctx.dcp_resume_state(elastic).state_dict())
    before = (detctx.capture(), elastic.epoch, elastic.consumed)
    with pytest.raises(detctx.CheckpointError, match=words):
        detctx.dcp_resume_state(elastic).load_state_dict(entry)
    assert (detctx.capture(), elastic.epoch, elastic.consumed) == before


def test_a_checkpoint_of_another_run_is_refused_with_nothing_changed() -> None:
    saved = detctx.dcp_resume_state(loader(seed=8)).state_dict()
    elastic = loader(seed=7)
    take(1, elastic)
    before = (detctx.capture(), elastic.consumed)
    with pytest.raises(detctx.CheckpointError, match="seed=8"):
        detctx.dcp_resume_state(elastic).load_state_dict(saved)
    assert (detctx.capture(), elastic.consumed) == before


def test_another_world_size_loads_an_elastic_position_but_refuses_a_resumable_loader() -> None:
    # As saved on 2 ranks: both ranks' resume states, the elastic position once.
    two_ranks = loader(batch_size=1)
    take(3, two_ranks)
    state = dcp_state._to_bytes(detctx.resume_state(two_ranks))
    entry = with_payload(world_size=2, ranks=[state, state], elastic=[two_ranks.state_dict()])
    one_rank = loader(batch_size=1)
    rng = detctx.capture()
    detctx.dcp_resume_state(one_rank).load_state_dict(entry)
    assert (one_rank.consumed, detctx.capture()) == (3, rng)  # RNGs left as they were

    resumable = detctx.resumable_loader(list(range(8)), batch_size=2, seed=1)
    with pytest.raises(detctx.CheckpointError, match="only elastic loaders"):
        detctx.dcp_resume_state(resumable).load_state_dict(entry)


@pytest.mark.slow
@pytest.mark.usefixtures("one_rank_group")
def test_a_checkpoint_of_another_mesh_layout_is_refused_with_nothing_changed() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    saved_on = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))
    elastic = loader()
    with detctx.distributed_deterministic(seed=1, mesh=saved_on, distinct_dims=("pp",)):
        saved = detctx.dcp_resume_state(elastic).state_dict()
        detctx.dcp_resume_state(elastic).load_state_dict(saved)  # the same layout resumes
    other = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "pp"))
    take(1, elastic)
    with detctx.distributed_deterministic(seed=1, mesh=other, distinct_dims=("pp",)):
        before = (detctx.capture(), elastic.consumed)
        with pytest.raises(detctx.CheckpointError, match=r"saved on a mesh with dims \['pp'"):
            detctx.dcp_resume_state(elastic).load_state_dict(saved)
        assert (detctx.capture(), elastic.consumed) == before
