"""Each sample's streams come from 64 bits: two samples never draw the same augmentation.

An elastic loader seeds Python's ``random``, NumPy's global generator and torch's CPU generator
before each sample from ``(seed, epoch, index)``. With 32-bit seeds about 190 pairs of an
ImageNet epoch (1.28M samples) drew bit-identical augmentation; ``torch.manual_seed`` and
NumPy's int seeding keep 32 bits of a seed, so a 64-bit seed must reach them otherwise.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx
from detctx._data import KeyedCollate
from detctx._data.elastic_streams import Keys
from detctx._data.keyed_collate import keyed_streams
from detctx._sources import registered_sources


def draws(reseed: Any, seed: int) -> tuple[list[float], list[float], float]:
    reseed(seed)
    return torch.rand(3).tolist(), np.random.random_sample(3).tolist(), random.random()


def test_the_seeds_of_two_million_samples_of_an_epoch_are_64_bit_and_all_different() -> None:
    seeds, _ = Keys(1234, None).seeds(0, np.arange(2_000_000), [])

    as_array = np.array(seeds, dtype=np.uint64)
    assert len(np.unique(as_array)) == 2_000_000
    # The seeds span 64 bits; their high halves alone (32-bit seeds) meet about n**2 / 2**33
    # times: what collided before.
    assert int(as_array.max()) > 2**63
    assert len(np.unique(as_array >> np.uint64(32))) < 2_000_000 - 300


def test_two_seeds_that_differ_only_above_bit_31_draw_different_torch_numpy_and_python() -> None:
    low = 0x0000_0000_89AB_CDEF
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with keyed_streams(list(registered_sources())) as reseed:
            first = draws(reseed, low)
            for high in (1, 2**31, 2**32 - 1):
                other = draws(reseed, low + (high << 32))
                assert [a != b for a, b in zip(first, other)] == [True, True, True], high


def test_a_sample_in_the_keyed_world_reports_its_64_bit_seed_as_torchs_initial_seed() -> None:
    seed = 0xFEDC_BA98_7654_3210
    with keyed_streams(list(registered_sources())) as reseed:
        reseed(seed)
        assert torch.initial_seed() == seed


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8, unique=True))
def test_seeds_prepared_as_a_batch_draw_what_each_seeded_alone_draws(seeds: list[int]) -> None:
    sources = list(registered_sources())
    world = keyed_streams(sources)
    with world as reseed:
        alone = [draws(reseed, seed) for seed in seeds]
    world.prepare(seeds)
    with world as reseed:
        prepared = [draws(reseed, seed) for seed in seeds]
    assert prepared == alone
    assert len({str(one) for one in alone}) == len(seeds)


def test_no_two_of_200_000_samples_of_an_epoch_draw_the_same_augmentation() -> None:
    # With 32-bit seeds about n**2 / 2**33 pairs (5 here) drew the very same stream.
    class Augmented(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 200_000

        def __getitem__(self, index: int) -> Any:
            return torch.randint(2**62, (1,))

    loader = detctx.elastic_loader(
        Augmented(), batch_size=10_000, seed=1234, shuffle=False, streams=["torch"]
    )
    drawn = torch.cat([batch.flatten() for batch in loader])
    assert len(drawn) == 200_000
    assert len(torch.unique(drawn)) == 200_000


def test_a_keyed_collators_batches_are_keyed_by_64_bit_seeds() -> None:
    from detctx._basics import content_seed

    seeds = {content_seed(5, 0, bytes([byte]) * 16) for byte in range(64)}
    assert len(seeds) == 64 and max(seeds) >= 2**32
    collator = KeyedCollate(lambda features: torch.rand(1).item(), seed=5)
    assert collator([torch.tensor([1.0])]) == collator([torch.tensor([1.0])])
    assert collator([torch.tensor([1.0])]) != collator([torch.tensor([2.0])])


@pytest.mark.parametrize("streams", [None, ["torch"]])
def test_an_elastic_loader_loads_the_same_samples_with_workers_or_without(
    streams: list[str] | None,
) -> None:
    class Augmented(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, index: int) -> Any:
            if streams is None:
                return torch.rand(2) + float(np.random.random_sample()) + random.random()
            return torch.rand(2) + index

    def epoch(workers: int) -> list[torch.Tensor]:
        loader = detctx.elastic_loader(
            Augmented(), batch_size=4, seed=9, streams=streams, num_workers=workers
        )
        return list(loader)

    alone, with_workers = epoch(0), epoch(2)
    assert all(torch.equal(a, b) for a, b in zip(alone, with_workers, strict=True))
