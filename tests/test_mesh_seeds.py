"""distributed_deterministic over a DeviceMesh: torchtitan's seeds, distinct along named dims."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import reduce
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, TESTS
from hypothesis import given
from hypothesis import strategies as st

import detctx
from detctx._basics import MAX_SEED, mesh_seed
from detctx.distributed import MegatronSeeds

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is absent"
)

SEED = 1000


def torchtitan_rule(seed: int, local_ranks: list[int], sizes: list[int]) -> int:
    """torchtitan's set_determinism, written out from its description in
    /work/shared/reference/determinism-facts.md: seed + sum of local_rank(d_i) * prod of
    size(d_j) for j < i, over the distinct dims in order (then modulo 2**64)."""
    offset = sum(
        rank * reduce(lambda a, b: a * b, sizes[:i], 1) for i, rank in enumerate(local_ranks)
    )
    return (seed + offset) % 2**64


@given(
    seed=st.integers(0, MAX_SEED),
    dims=st.lists(
        st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))),
        max_size=4,
    ),
)
def test_mesh_seeds_are_torchtitans_numbers_wherever_numpy_can_take_them(
    seed: int, dims: list[tuple[int, int]]
) -> None:
    sizes, local_ranks = [size for size, _ in dims], [rank for _, rank in dims]
    expected = torchtitan_rule(seed, local_ranks, sizes)
    got = mesh_seed(seed, local_ranks, sizes)
    # Past 2**32 - 1 (a seed within a world size of the top) NumPy cannot take the number:
    # detctx wraps it, as it does Megatron's offsets.
    assert got == expected % 2**32
    if expected <= MAX_SEED:
        assert got == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"distinct_dims": ("pp",)}, ValueError, "pass mesh="),
        ({"mesh": object(), "distinct_dims": ("pp",)}, TypeError, "DeviceMesh"),
        ({"mesh": object(), "per_rank": True}, ValueError, "pass one of them"),
        ({"mesh": object(), "megatron_seeds": MegatronSeeds(pp_rank=1)}, ValueError, "one of them"),
    ],
)
def test_a_mesh_with_another_derivation_or_without_a_mesh_is_refused_at_construction(
    kwargs: dict[str, Any], error: type, words: str
) -> None:
    with pytest.raises(error, match=words):
        detctx.distributed_deterministic(seed=SEED, **kwargs)


def has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor import distribute_tensor  # noqa: F401
    except ImportError:
        return False
    return True


# The 4-rank script builds DTensors and shards with FSDP2 (torch 2.6 and later).
needs_fsdp2 = pytest.mark.skipif(not has_fsdp2(), reason="this torch has no FSDP2 or DTensor")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """``tests/mesh_ranks.py`` on 4 ranks, a (pp=2, dp=2) mesh; each rank's results."""
    out = tmp_path_factory.mktemp("mesh_ranks")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=4", str(TESTS / "mesh_ranks.py"), str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout}\n{proc.stderr}"
    return [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.slow
@needs_fsdp2
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_on_a_pp_dp_mesh_the_two_ranks_of_a_stage_draw_alike_and_stages_differ(
    four_ranks: list[dict[str, Any]],
) -> None:
    for result in four_ranks:
        pp_rank = result["coordinate"][0]
        assert result["pp"]["initial_seed"] == SEED + pp_rank
        assert result["pp"]["restored"]
        assert not result["pp"]["tracker"]  # OffsetBasedRNGTracker refuses CPU
    stage = {rank: four_ranks[rank]["pp"] for rank in range(4)}
    draws = ("torch", "numpy", "random", "dtensor")
    assert [stage[0][d] for d in draws] == [stage[1][d] for d in draws]
    assert [stage[2][d] for d in draws] == [stage[3][d] for d in draws]
    assert all(stage[0][d] != stage[2][d] for d in draws)


@pytest.mark.slow
@needs_fsdp2
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_several_distinct_dims_give_each_rank_torchtitans_seed(
    four_ranks: list[dict[str, Any]],
) -> None:
    for result in four_ranks:
        pp_rank, dp_rank = result["coordinate"]
        expected = torchtitan_rule(SEED, [dp_rank, pp_rank], [2, 2])
        assert result["dp, pp"]["initial_seed"] == result["dp, pp"]["seed"] == expected
        assert result["no distinct dims"]["initial_seed"] == SEED
    assert len({result["dp, pp"]["seed"] for result in four_ranks}) == 4


@pytest.mark.slow
@needs_fsdp2
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_a_mesh_the_rank_is_not_in_and_disagreeing_ranks_are_refused(
    four_ranks: list[dict[str, Any]],
) -> None:
    assert [result["not in the mesh"] for result in four_ranks[:2]] == ["no error"] * 2
    for result in four_ranks[2:]:
        assert result["not in the mesh"].startswith(
            f"ValueError: rank {result['rank']} is not in the mesh"
        )
    for result in four_ranks:
        assert result["with per_rank"].startswith("ValueError")
        # Every rank raises the same error after the same collective.
        assert result["ranks disagree on the dims"].startswith("SeedMismatchError")
        assert "on ranks 0, 2" in result["ranks disagree on the dims"]


class FakeTrackerModule:
    """What detctx uses of ``torch.distributed.tensor._random`` on a device with an RNG
    tracker (CUDA-like devices; this machine has none): the tracker slot and ``manual_seed``,
    which makes a tracker without state sync where there is none, as torch 2.13's does."""

    class OffsetBasedRNGTracker:
        def __init__(self, mesh: Any, run_state_sync: bool = True) -> None:
            self.mesh, self.run_state_sync = mesh, run_state_sync
            self.rng_states = {"parallel-rng": torch.tensor([1, 2], dtype=torch.uint8)}

    _rng_tracker: Any = None

    def manual_seed(self, seed: int, mesh: Any) -> None:
        if self._rng_tracker is None:
            self._rng_tracker = self.OffsetBasedRNGTracker(mesh, run_state_sync=False)
        self._rng_tracker.rng_states["parallel-rng"] = torch.tensor([seed], dtype=torch.uint8)


def test_the_dtensor_tracker_is_seeded_on_entry_and_put_back_on_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from detctx.distributed import _mesh

    module = FakeTrackerModule()
    monkeypatch.setattr(_mesh, "_tracker_module", lambda device_type: module)
    entry = _mesh.TrackerEntry(mesh="the mesh", seed=7)
    made = module._rng_tracker
    assert (made.mesh, made.run_state_sync) == ("the mesh", False)
    entry.restore()
    assert module._rng_tracker is None

    # A tracker that was there already is kept, its own states put back on exit.
    made.rng_states["parallel-rng"] = torch.tensor([1, 2], dtype=torch.uint8)
    module._rng_tracker = made
    entry = _mesh.TrackerEntry(mesh="the mesh", seed=9)
    assert made.rng_states["parallel-rng"].tolist() == [9]
    entry.restore()
    assert module._rng_tracker is made
    assert made.rng_states["parallel-rng"].tolist() == [1, 2]


def test_on_a_cpu_mesh_torch_has_no_tracker_to_make() -> None:
    from detctx.distributed import _mesh

    assert _mesh._tracker_module("cpu") is None


@pytest.mark.slow
@needs_fsdp2
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_fully_shard_keeps_each_ranks_shard_of_its_own_initialisation(
    four_ranks: list[dict[str, Any]],
) -> None:
    # docs/mesh.md: built where the dp ranks' streams differ, the sharded model is a
    # patchwork of the ranks' initialisations (fully_shard does not broadcast).
    for result in four_ranks:
        seen = result["fully_shard after a distinct init"]
        assert seen == {"own rows kept": True, "whole layer is this rank's": False}


@pytest.mark.slow
@needs_fsdp2
@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    ("distinct_dims", "error", "words"),
    [
        ("pp", TypeError, "a sequence of mesh dim names"),
        (("pp", "pp"), ValueError, "names a dim twice"),
        ((1,), TypeError, "dim names"),
    ],
)
def test_distinct_dims_that_are_not_the_meshs_dims_are_refused_at_construction(
    distinct_dims: Any, error: type, words: str
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))
    with pytest.raises(error, match=words):
        detctx.distributed_deterministic(seed=SEED, mesh=mesh, distinct_dims=distinct_dims)


@pytest.mark.slow
@needs_fsdp2
@pytest.mark.usefixtures("one_rank_group")
def test_a_distinct_dim_the_mesh_leaves_out_is_taken_as_a_dim_of_size_1() -> None:
    # torchtitan leaves size-1 dims out of its meshes and passes ["pp"] when pp=1.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    with detctx.distributed_deterministic(seed=SEED, mesh=mesh, distinct_dims=("pp",)) as run:
        assert run.mesh_seeds is not None
        assert (run.mesh_seeds.local_ranks, run.mesh_seeds.sizes) == ((0,), (1,))
        assert torch.initial_seed() == torchtitan_rule(SEED, [0], [1]) == SEED
