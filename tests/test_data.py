"""Multi-worker DataLoaders: the same batches every run, distinct per worker and per rank."""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ROOT, TESTS
from torch.utils.data import DataLoader, Dataset

import detctx


class AugmentedIndices(Dataset[tuple[int, int, float, float, float]]):
    """Each item: its index, the worker that read it and one draw from each RNG there."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[int, int, float, float, float]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else -1
        return index, worker, random.random(), float(np.random.rand()), torch.rand(1).item()


def epoch(
    worker_init_fn: Any = detctx.seed_worker, seed: int = 7, generator: Any = None
) -> list[tuple[Any, ...]]:
    loader = DataLoader(
        AugmentedIndices(),
        batch_size=None,
        shuffle=True,
        num_workers=2,
        generator=detctx.loader_generator(seed) if generator is None else generator,
        worker_init_fn=worker_init_fn,
    )
    return [tuple(item) for item in loader]


def first_draws_per_worker(items: list[tuple[Any, ...]]) -> dict[int, tuple[Any, ...]]:
    first: dict[int, tuple[Any, ...]] = {}
    for _, worker, *values in items:
        first.setdefault(worker, tuple(values))
    return first


def test_two_worker_loading_with_shuffling_repeats_exactly(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)

    assert epoch() == epoch()


def test_each_worker_draws_its_own_numbers():
    first = first_draws_per_worker(epoch())

    assert sorted(first) == [0, 1]
    for draw_0, draw_1 in zip(first[0], first[1]):
        assert draw_0 != draw_1


def test_each_rank_gets_its_own_worker_seeds_even_where_its_workers_cannot_see_the_rank(
    monkeypatch,
):
    monkeypatch.delenv("RANK", raising=False)
    rank_0 = epoch()
    monkeypatch.setenv("RANK", "1")  # as torchrun sets it for the second process
    rank_1 = epoch()
    # Under torch.multiprocessing.spawn a spawn-started worker sees no $RANK and no
    # process group: the rank travels in the generator built on rank 1.
    monkeypatch.delenv("RANK")
    rank_1_blind_workers = epoch(generator=detctx.loader_generator(7, rank=1))

    draws = [first_draws_per_worker(run) for run in (rank_0, rank_1, rank_1_blind_workers)]
    for worker in (0, 1):
        seen = [run[worker] for run in draws]
        assert len(set(seen)) == 3, seen
    monkeypatch.setenv("RANK", "1")
    assert epoch() == rank_1


@pytest.mark.slow
def test_under_torch_multiprocessing_spawn_every_rank_and_worker_draws_its_own_numbers(
    tmp_path: Path,
) -> None:
    out = tmp_path / "ranks.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    env.pop("RANK", None)
    subprocess.run(
        [sys.executable, str(TESTS / "spawned_loader_ranks.py"), str(out)],
        check=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    ranks = json.loads(out.read_text())

    seeds, draws = {}, {}
    for rank, (first_epoch, second_epoch) in ranks.items():
        assert first_epoch == second_epoch  # each block gives the same seeds again
        for worker, seed, *values, sees_rank in first_epoch:
            assert not sees_rank  # the worker cannot tell its rank ...
            seeds.setdefault((rank, worker), seed)
            draws.setdefault((rank, worker), tuple(values))
    assert len(seeds) == 4
    assert len(set(seeds.values())) == 4  # ... yet every (rank, worker) has its own seed
    assert len(set(draws.values())) == 4


def test_one_generator_for_every_rank_shares_the_order_and_named_ranks_keep_augmentation_apart(
    monkeypatch,
):
    monkeypatch.delenv("RANK", raising=False)
    rank_0 = epoch(generator=detctx.loader_generator(7, rank=0))
    rank_1 = epoch(
        functools.partial(detctx.seed_worker, rank=1), generator=detctx.loader_generator(7, rank=0)
    )

    assert [item[0] for item in rank_0] == [item[0] for item in rank_1]
    assert all(a[2:] != b[2:] for a, b in zip(rank_0, rank_1))


def test_the_data_order_does_not_depend_on_the_models_randomness():
    def order(extra_draws: int) -> list[int]:
        with detctx.deterministic(seed=3):
            loader = DataLoader(
                range(12), batch_size=4, shuffle=True, generator=detctx.loader_generator()
            )
            batches = []
            for batch in loader:
                torch.rand(extra_draws)  # dropout in a model that changed
                batches += batch.tolist()
            return batches

    assert order(1) == order(1000)


def test_the_generator_follows_the_blocks_seed_when_none_is_given():
    with detctx.deterministic(seed=5):
        inside = torch.rand(4, generator=detctx.loader_generator())
    torch.manual_seed(5)
    after_manual_seed = torch.rand(4, generator=detctx.loader_generator())
    explicit = torch.rand(4, generator=detctx.loader_generator(5))

    assert torch.equal(inside, explicit)
    assert torch.equal(after_manual_seed, explicit)
    # A derived seed: the loader's stream is not the global stream of the same seed.
    assert not torch.equal(explicit, torch.rand(4, generator=torch.Generator().manual_seed(5)))


AUGMENT = random.Random(0)


class AugmentedByOwnRNG(Dataset[tuple[int, float]]):
    """Draws from a library's own ``random.Random``, not the global one."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[int, float]:
        info = torch.utils.data.get_worker_info()
        return (info.id if info is not None else -1), AUGMENT.random()


def own_rng_draws(worker_init_fn: Any) -> list[tuple[int, float]]:
    loader = DataLoader(
        AugmentedByOwnRNG(),
        batch_size=None,
        num_workers=2,
        generator=detctx.loader_generator(1),
        worker_init_fn=worker_init_fn,
    )
    return [(int(worker), float(value)) for worker, value in loader]


def test_seed_worker_also_seeds_registered_sources_per_worker(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    unseeded = own_rng_draws(None)
    detctx.register_source("augment", AUGMENT)
    try:
        seeded = own_rng_draws(detctx.seed_worker)
        again = own_rng_draws(detctx.seed_worker)
    finally:
        detctx.unregister_source("augment")

    def first_per_worker(draws: list[tuple[int, float]]) -> list[float]:
        return [next(value for worker, value in draws if worker == w) for w in (0, 1)]

    # Forked workers inherit one copy of the generator: both draw the same numbers.
    assert first_per_worker(unseeded)[0] == first_per_worker(unseeded)[1]
    assert first_per_worker(seeded)[0] != first_per_worker(seeded)[1]
    assert seeded == again


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: detctx.loader_generator("7"), TypeError, "seed must be an integer"),
        (lambda: detctx.loader_generator(-1), ValueError, "seed must be in"),
        (lambda: detctx.seed_worker(True), TypeError, "worker_id"),
        (lambda: detctx.seed_worker(-1), ValueError, "worker_id"),
        (lambda: detctx.seed_worker(0, rank=1.0), TypeError, "rank"),
        (lambda: detctx.loader_generator(1, rank=-1), ValueError, "rank"),
    ],
)
def test_bad_arguments_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_rank_variable_that_is_not_a_number_is_named(monkeypatch):
    monkeypatch.setenv("RANK", "first")

    with pytest.raises(ValueError, match=r"\$RANK='first'"):
        detctx.seed_worker(0)


def test_the_world_size_a_loader_state_records_comes_from_torchrun_and_a_bad_value_is_named(
    monkeypatch,
):
    from detctx._data.loader import current_world_size

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert current_world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert current_world_size() == 4
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE.*number of ranks"):
        current_world_size()
    pytest.importorskip("torchdata.stateful_dataloader")
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE"):
        detctx.resumable_loader(AugmentedIndices(), batch_size=4)
