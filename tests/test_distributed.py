"""distributed_deterministic across real processes (gloo on loopback), and its local parts."""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import launch_ranks, run_python

import detctx
from detctx import (
    DeterminismWarning,
    DistributedSeeding,
    SeedMismatchError,
    collective_device,
    distributed_deterministic,
    group_seed,
    prepare_environment,
    verify_across_ranks,
)
from detctx._state.snapshot import active_sources
from detctx.distributed._agreement import decide
from detctx.distributed._rank_check import compare_rows, verification_row

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is absent")

WORKER = Path(__file__).with_name("distributed_worker.py")
LAUNCH_TIMEOUT_S = 150


def launch(world_size: int, *options: str) -> list[dict[str, Any]]:
    """Run ``distributed_worker.py`` on ``world_size`` ranks; each rank's results, by rank."""
    return launch_ranks(WORKER, world_size, *options, timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return launch(4)


@pytest.fixture(scope="module")
def two_ranks_twice() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return launch(2, "train"), launch(2, "train")


@pytest.fixture(params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """What each rank saw, in the 4-rank launch or the first 2-rank one."""
    if request.param == 4:
        return request.getfixturevalue("four_ranks")
    return request.getfixturevalue("two_ranks_twice")[0]


def by_rank(results: list[dict[str, Any]], *path: str) -> list[Any]:
    values = []
    for result in results:
        for key in path:
            result = result[key]
        values.append(result)
    return values


# --- multi-process scenarios ---------------------------------------------------------------


@pytest.mark.slow
def test_seed_none_every_rank_uses_the_source_ranks_seed(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    # Each rank was launched with DETCTX_SEED=1000+rank: only the source rank's is read.
    from_rank0 = by_rank(ranks, "agreement", "from_rank0")
    assert [seed for seed, _ in from_rank0] == [1000] * world
    assert all(draws == from_rank0[0][1] for _, draws in from_rank0)
    assert [seed for seed, _ in by_rank(ranks, "agreement", "from_last")] == [999 + world] * world
    entropy = by_rank(ranks, "agreement", "entropy")
    assert all(item == entropy[0] for item in entropy)
    for form in ("decorated", "generator", "coroutine"):
        results = by_rank(ranks, "agreement", form)
        assert all(item == results[0] for item in results), form


def test_different_seeds_raise_the_same_error_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    seen = by_rank(ranks, "mismatches")
    last = seen[0]["last_rank_differs"]
    assert last["seeds"] == [100] * (world - 1) + [101]
    assert f"seed=101 on rank {world - 1}" in last["message"]
    assert all(rank_seen["last_rank_differs"] == last for rank_seen in seen)
    none_vs_explicit = seen[0]["none_vs_explicit"]
    assert none_vs_explicit["seeds"] == [None] + [5] * (world - 1)
    assert all(rank_seen["none_vs_explicit"] == none_vs_explicit for rank_seen in seen)
    assert all("per_rank=True on rank 1" in s["per_rank_differs"]["message"] for s in seen)
    assert all(rank_seen["state_untouched"] for rank_seen in seen)


def test_streams_are_shared_or_per_rank(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    streams = by_rank(ranks, "streams")
    assert all(s["shared"] == streams[0]["shared"] for s in streams)
    per_rank = [tuple(s["per_rank"]) for s in streams]
    assert len(set(per_rank)) == world
    assert all(s["per_rank_seed"] == s["expected_seed"] for s in streams)
    assert [s["run"] for s in streams] == [[1234, rank, world] for rank in range(world)]


def test_per_rank_streams_repeat_across_launches(two_ranks_twice: Any) -> None:
    first, second = two_ranks_twice
    assert by_rank(first, "streams", "per_rank") == by_rank(second, "streams", "per_rank")


def test_verify_names_the_ranks_that_drew_extra_numbers(four_ranks: Any) -> None:
    caught = by_rank(four_ranks, "divergence", "caught")
    assert caught[0]["divergent"] == {"1": ["numpy"], "3": ["torch"]}
    assert "rank 1: numpy; rank 3: torch" in caught[0]["message"]
    assert all(item == caught[0] for item in caught)


def test_verify_on_two_ranks_takes_rank_0_as_the_reference(two_ranks_twice: Any) -> None:
    caught = by_rank(two_ranks_twice[0], "divergence", "caught")
    assert [item["divergent"] for item in caught] == [{"1": ["torch"]}] * 2


def test_verify_true_checks_on_exit_and_still_restores(ranks: list[dict[str, Any]]) -> None:
    world = len(ranks)
    seen = by_rank(ranks, "divergence")
    # Rank 0 drew once more; with 2 ranks the tie is decided for rank 0.
    expected = {"0": ["python"]} if world > 2 else {"1": ["python"]}
    assert [s["on_exit"]["divergent"] for s in seen] == [expected] * world
    assert all(s["restored_after_exit_check"] for s in seen)


def test_ddp_training_loss_curve_is_bit_identical_across_launches(two_ranks_twice: Any) -> None:
    first, second = two_ranks_twice
    assert by_rank(first, "train") == by_rank(second, "train")
    losses = by_rank(first, "train", "losses")
    assert losses[0] != losses[1]  # each rank trains on its own per-rank batches
    weights = by_rank(first, "train", "weights")
    assert weights[0] == weights[1]  # and DDP keeps the replicas identical


def test_a_rank_raising_in_a_verify_block_is_named_to_the_others(
    ranks: list[dict[str, Any]],
) -> None:
    seen = by_rank(ranks, "failures")
    assert seen[1]["raised"] == "its own ValueError"
    others = [s["raised"] for rank, s in enumerate(seen) if rank != 1]
    assert all(item["failed"] == [[1, "ValueError"]] for item in others)
    assert all(
        item["message"].startswith("rank 1 raised ValueError inside the distributed_deterministic")
        for item in others
    )
    assert not any("differ" in item["message"] for item in others)
    assert all(s["restored_after_raise"] for s in seen)


def test_ranks_that_never_arrive_are_named_on_every_waiting_rank(
    ranks: list[dict[str, Any]],
) -> None:
    world = len(ranks)
    missing = [rank for rank in range(world) if rank % 2]
    named = "rank 1" if world == 2 else "ranks 1, 3"
    for rank in range(0, world, 2):
        seen = ranks[rank]["failures"]
        for form in ("block", "agree_seed"):
            assert seen[form]["missing"] == missing, (rank, form)
            assert f"{named} did not arrive" in seen[form]["message"]
            assert "did not complete within 3 s" in seen[form]["message"]
        assert seen["restored_after_timeout"]


# --- outside a process group ---------------------------------------------------------------


def test_outside_a_process_group_it_is_deterministic() -> None:
    with detctx.deterministic(seed=77):
        expected = (random.random(), float(np.random.rand()), torch.rand(3))
    before = detctx.fingerprint()
    with distributed_deterministic(seed=77) as run:
        got = (random.random(), float(np.random.rand()), torch.rand(3))
        verify_across_ranks()  # nothing to compare with: no collective, no error
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    assert isinstance(run, DistributedSeeding)
    assert (run.seed, run.shared_seed, run.rank, run.world_size) == (77, 77, 0, 1)
    assert detctx.fingerprint() == before


def test_outside_a_process_group_per_rank_is_rank_0_of_1() -> None:
    with distributed_deterministic(seed=77, per_rank=True) as run:
        drawn = torch.rand(2)
    with detctx.deterministic(seed=detctx.derive_seed(77, 0)):
        assert torch.equal(drawn, torch.rand(2))
    assert run.seed == detctx.derive_seed(77, 0) and run.shared_seed == 77


def test_decorated_function_runs_in_its_own_block() -> None:
    @distributed_deterministic(seed=5)
    def sample() -> torch.Tensor:
        return torch.rand(2)

    before = detctx.fingerprint()
    assert torch.equal(sample(), sample())
    assert detctx.fingerprint() == before


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"per_rank": "yes"}, TypeError),
        ({"src": -1}, ValueError),
        ({"src": True}, TypeError),
        ({"group": "world"}, TypeError),
        ({"verify": 1}, TypeError),
        ({"seed": 1.5}, TypeError),
        ({"seed": -3}, ValueError),
        ({"hccl": "maybe"}, ValueError),
        ({"timeout": 0}, ValueError),
        ({"timeout": -1.0}, ValueError),
        ({"timeout": float("inf")}, ValueError),
        ({"timeout": float("nan")}, ValueError),
        ({"timeout": "60"}, TypeError),
        ({"timeout": True}, TypeError),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        distributed_deterministic(**kwargs)


def test_mismatch_message_lists_every_rank_compactly() -> None:
    rows = [[9, 1, 0]] * 6 + [[8, 1, 0]] + [[9, 1, 0]]
    with pytest.raises(SeedMismatchError) as caught:
        decide(rows, 0)
    assert "seed=9 on ranks 0-5, 7; seed=8 on rank 6" in str(caught.value)
    assert caught.value.seeds == (9, 9, 9, 9, 9, 9, 8, 9)


def test_a_rank_managing_other_sources_is_named() -> None:
    usual = sorted(active_sources(), key=lambda item: item[0])
    extra = [*usual, ("sampler", detctx._sources.registry.as_source(random.Random(3)))]
    rows = [verification_row(None, usual)[0]] * 2 + [verification_row(None, extra)[0]]
    names = [name for name, _ in usual]
    assert compare_rows(rows, rows[0], names) == {2: ("sources",)}


# --- parallel layouts ----------------------------------------------------------------------


def test_group_seeds_do_not_collide_where_megatron_offsets_do() -> None:
    # Megatron: seed + 100 * pp_rank + 10 * dp_rank gives pp=1, dp=0 and pp=0, dp=10 one seed.
    assert group_seed(1234, pp=1, dp=0) != group_seed(1234, pp=0, dp=10)
    layout = {
        group_seed(1234, tp=tp, pp=pp, dp=dp)
        for tp in range(8)
        for pp in range(8)
        for dp in range(16)
    }
    assert len(layout) == 8 * 8 * 16
    assert group_seed(1234, tp=3, pp=1) == group_seed(1234, pp=1, tp=3)
    assert group_seed(1234, tp=3) != group_seed(1235, tp=3)
    with pytest.raises(TypeError):
        group_seed(1234)


def test_run_derives_group_seeds_from_the_shared_seed() -> None:
    with distributed_deterministic(seed=42, per_rank=True) as run:
        assert run.group_seed(tp=1) == group_seed(42, tp=1)


# --- environment and devices ---------------------------------------------------------------


def test_prepare_environment_sets_variables_and_nothing_else() -> None:
    # The autouse fixture in conftest.py starts each test with these variables unset.
    algorithms_before = torch.are_deterministic_algorithms_enabled()
    rng_before = detctx.fingerprint()
    applied = prepare_environment(seed=99, hccl="strict")
    assert applied == {
        "PYTHONHASHSEED": "99",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "HCCL_DETERMINISTIC": "strict",
        "CLOSE_MATMUL_K_SHIFT": "1",
        "FLASH_ATTENTION_DETERMINISTIC": "1",
        "DETCTX_SEED": "99",
    }
    assert all(os.environ[name] == value for name, value in applied.items())
    assert torch.are_deterministic_algorithms_enabled() == algorithms_before
    assert detctx.fingerprint() == rng_before


def test_prepare_environment_without_seed_leaves_seed_variables_alone() -> None:
    applied = prepare_environment(cublas_workspace=False)
    assert applied == {
        "HCCL_DETERMINISTIC": "true",
        "CLOSE_MATMUL_K_SHIFT": "1",
        "FLASH_ATTENTION_DETERMINISTIC": "1",
    }
    assert "PYTHONHASHSEED" not in os.environ and "DETCTX_SEED" not in os.environ


def test_prepare_environment_rejects_bad_options_before_setting_anything() -> None:
    with pytest.raises(ValueError, match="hccl"):
        prepare_environment(hccl="1")  # "1" is not a documented HCCL_DETERMINISTIC value
    assert "HCCL_DETERMINISTIC" not in os.environ


def test_superpod_topology_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HCCL_LOGIC_SUPERPOD_ID", "2")
    with pytest.warns(DeterminismWarning, match="HCCL_LOGIC_SUPERPOD_ID.*same topology"):
        with distributed_deterministic(seed=1):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with distributed_deterministic(seed=1, hccl=False):
            pass


@pytest.fixture
def hccl_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-rank process group that reports itself as HCCL (gloo underneath)."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "hccl")
        yield
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_hccl_variable_set_after_the_group_exists_warns_how_to_set_it(
    hccl_group: None,
) -> None:
    with pytest.warns(DeterminismWarning, match="export HCCL_DETERMINISTIC=true") as record:
        with distributed_deterministic(seed=3) as run:
            assert os.environ["HCCL_DETERMINISTIC"] == "true"
    assert "HCCL_DETERMINISTIC" in str(record[0].message)
    assert "HCCL_DETERMINISTIC" not in os.environ
    assert run.world_size == 1


def test_hccl_variable_exported_before_launch_gives_no_warning(
    hccl_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HCCL_DETERMINISTIC", "strict")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with distributed_deterministic(seed=3, hccl="strict"):
            assert os.environ["HCCL_DETERMINISTIC"] == "strict"


def test_collectives_use_cpu_tensors_for_gloo_and_mixed_backends() -> None:
    assert collective_device("gloo") == torch.device("cpu")
    assert collective_device("cpu:gloo,cuda:nccl") == torch.device("cpu")
    # init_process_group() without a backend: gloo for CPU tensors among torch's defaults
    assert collective_device("undefined") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"unknown torch\.distributed backend"):
        collective_device("carrier-pigeon")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_nccl_without_cuda_says_which_devices_are_missing() -> None:
    with pytest.raises(RuntimeError, match="'nccl' backend needs 'cuda' devices"):
        collective_device("nccl")


@pytest.mark.slow
def test_hccl_collectives_use_the_current_npu() -> None:
    out = run_python(
        """
        import simulated_npu as sim
        sim.install(2)
        import torch
        from detctx import collective_device

        sim.set_device(1)
        assert collective_device("hccl") == torch.device("npu", 1), collective_device("hccl")
        assert collective_device("npu:hccl") == torch.device("npu", 1)
        assert collective_device("cpu:gloo,npu:hccl") == torch.device("cpu")
        print("ok")
        """
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize(("timeout", "error"), [(0, ValueError), ("1", TypeError)])
def test_agree_seed_refuses_a_bad_timeout_before_any_collective(timeout: Any, error: type) -> None:
    with pytest.raises(error, match="timeout"):
        detctx.agree_seed(5, timeout=timeout)


@pytest.mark.parametrize("page", ["docs/frameworks.md", "docs/distributed.md"])
def test_the_docs_call_verify_across_ranks_inside_a_block_where_it_holds(page: str) -> None:
    # After the blocks each rank has put back its own pre-block state: a correct run
    # could fail the check there. Every example call must sit inside a block.
    text = (Path(__file__).resolve().parent.parent / page).read_text(encoding="utf-8")
    calls = [line for line in text.splitlines() if "detctx.verify_across_ranks()" in line]
    code_calls = [line for line in calls if not line.lstrip().startswith(("`", "-"))]
    assert code_calls, "the page shows no call"
    assert all(line.startswith((" ", "\t")) for line in code_calls), code_calls


def test_ranks_that_arrived_are_not_named_missing_when_the_store_answers_slowly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Torch 2.1's stores have no check(); a wait of a millisecond on a loaded machine timed
    # out for keys that were there, and named ranks that had arrived (this one included).
    from detctx.distributed import _arrival

    class SlowStore:
        """A store whose every wait times out, and which has no check()."""

        def __init__(self) -> None:
            self.inner = dist.HashStore()

        def add(self, key: str, value: int) -> int:
            return int(self.inner.add(key, value))

        def set(self, key: str, value: str) -> None:
            self.inner.set(key, value)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            raise RuntimeError("Socket Timeout")

    store = SlowStore()
    monkeypatch.setattr(_arrival, "default_store", lambda: store)
    prefix = "detctx/arrival/test/1"
    store.add(f"{prefix}/1", 1)  # rank 1 arrived before this one; rank 2 never does
    store.add(f"{prefix}/count", 1)
    assert _arrival._missing_ranks(prefix, 0, 3, timeout=0.2) == (2,)
    everyone = "detctx/arrival/test/2"
    for other in (1, 2):
        store.add(f"{everyone}/{other}", 1)
        store.add(f"{everyone}/count", 1)
    assert _arrival._missing_ranks(everyone, 0, 3, timeout=0.2) == ()
