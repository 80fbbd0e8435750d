"""Elastic resume in your own loop: the samples do not depend on who loads them."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import NoisyPoints
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx
from detctx import CheckpointError, UndeclaredStreamError

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def batches(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch (a resumed loader first finishes its epoch)."""
    while True:
        yield from loader


def train(workers: int, tmp_path: Path, *, resume: bool = False) -> dict[str, Any]:
    """11 steps of 6 samples over 20-sample epochs; saves a checkpoint after step 5."""
    with detctx.deterministic(seed=0):
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = detctx.elastic_loader(NoisyPoints(), batch_size=6, seed=1234, num_workers=workers)
    losses = []
    with detctx.deterministic(seed=5):  # the model's dropout streams
        start = 0
        if resume:
            checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            start = checkpoint["step"]
            detctx.resume(checkpoint["detctx"], loader)
        for step, (x, y) in zip(range(start, 11), batches(loader)):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if step + 1 == 5 and not resume:
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step + 1,
                    "detctx": detctx.resume_state(loader),
                }
                torch.save(checkpoint, tmp_path / "checkpoint.pt")
    return {"losses": losses, "weights": [p.detach().clone() for p in model.parameters()]}


@pytest.fixture(scope="module")
def straight_with_two_workers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("elastic")
    return folder, train(2, folder)


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_a_checkpoint_saved_with_two_workers_resumes_bit_for_bit_with_any_number_of_workers(
    straight_with_two_workers: tuple[Path, Any], workers: int
) -> None:
    # Step 5 is the second batch of the second epoch (the 20 samples make epochs of 4
    # batches, the last of 2); the resumed run crosses two epoch boundaries. Augmentation
    # draws from torch, NumPy and Python, and the model has dropout.
    folder, straight = straight_with_two_workers
    resumed = train(workers, folder, resume=True)
    assert resumed["losses"] == straight["losses"][5:]
    assert all(torch.equal(a, b) for a, b in zip(straight["weights"], resumed["weights"]))


def test_a_straight_run_with_no_workers_equals_one_with_three(tmp_path: Path) -> None:
    none, three = train(0, tmp_path), train(3, tmp_path)
    assert none["losses"] == three["losses"]
    assert all(torch.equal(a, b) for a, b in zip(none["weights"], three["weights"]))


def test_persistent_workers_load_the_same_epochs_as_the_main_process() -> None:
    def epochs(**options: Any) -> list[Any]:
        loader = detctx.elastic_loader(Indexed(10), batch_size=3, seed=2, **options)
        return [[t.tolist() for t in batch] for _ in range(3) for batch in loader]

    assert epochs(num_workers=2, persistent_workers=True) == epochs()


class Indexed(torch.utils.data.Dataset[tuple[int, float, float, float]]):
    """``size`` samples, each its index and one draw from torch, NumPy and Python."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, float, float, float]:
        return index, torch.rand(()).item(), float(np.random.rand()), random.random()


def global_sequence(loaders: list[Any], steps: int) -> list[tuple[float, ...]]:
    """The samples of ``steps`` steps over every rank's loader, ranks in rank order."""
    streams = [batches(loader) for loader in loaders]
    sequence: list[tuple[float, ...]] = []
    for _ in range(steps):
        for stream in streams:
            sequence += [tuple(row) for row in torch.stack(next(stream), dim=1).tolist()]
    return sequence


def ranks(world: int, size: int, per_rank: int, drop_last: bool = True) -> list[Any]:
    return [
        detctx.elastic_loader(
            Indexed(size),
            batch_size=per_rank,
            seed=9,
            rank=rank,
            world_size=world,
            drop_last=drop_last,
        )
        for rank in range(world)
    ]


@settings(max_examples=30, deadline=None)
@given(
    layout=st.sampled_from([(1, 12), (2, 6), (3, 4), (4, 3), (6, 2)]),
    resumed_layout=st.sampled_from([(1, 12), (2, 6), (3, 4), (4, 3), (6, 2)]),
    size=st.integers(12, 40),
    stop=st.integers(0, 7),
)
def test_the_global_sequence_resumed_on_another_world_size_is_the_straight_one(
    layout: tuple[int, int], resumed_layout: tuple[int, int], size: int, stop: int
) -> None:
    # A global batch of 12 split over 1 to 6 ranks: stop after any step, resume on
    # another split; the sequence of (index, draws) goes on as the straight run's,
    # epoch boundaries included.
    straight = global_sequence(ranks(1, size, 12), stop + 6)
    first = ranks(layout[0], size, layout[1])
    before = global_sequence(first, stop)
    state = first[0].state_dict()
    assert all(loader.state_dict() == state for loader in first)
    resumed = ranks(resumed_layout[0], size, resumed_layout[1])
    for loader in resumed:
        loader.load_state_dict(state)
    assert before + global_sequence(resumed, 6) == straight


@settings(max_examples=25, deadline=None)
@given(
    draws=st.lists(st.sampled_from(["torch", "numpy", "python"]), max_size=4),
    taken=st.integers(0, 5),
)
def test_loading_in_this_process_puts_the_callers_streams_back_after_each_batch(
    draws: list[str], taken: int
) -> None:
    # num_workers=0: the samples are read here, in their own keyed streams; the streams
    # of the code around the loop go on as if no sample had been read.
    draw = {
        "torch": lambda: torch.rand(()).item(),
        "numpy": np.random.rand,
        "python": random.random,
    }
    loader = detctx.elastic_loader(Indexed(10), batch_size=3, seed=2)
    stream = batches(loader)
    with detctx.deterministic(seed=1):
        for _ in range(taken):
            next(stream)
        seen = [float(draw[name]()) for name in draws]
        after = detctx.fingerprint()
    with detctx.deterministic(seed=1):
        expected = [float(draw[name]()) for name in draws]
        assert detctx.fingerprint() == after
    assert seen == expected


def test_a_sample_that_raises_leaves_the_callers_streams_as_they_were() -> None:
    class Failing(Indexed):
        def __getitem__(self, index: int) -> tuple[int, float, float, float]:
            if index == 4:
                raise OSError("unreadable file")
            return super().__getitem__(index)

    loader = detctx.elastic_loader(Failing(8), batch_size=8, seed=2, shuffle=False)
    before = detctx.fingerprint()
    with pytest.raises(OSError, match="unreadable"):
        next(iter(loader))
    assert detctx.fingerprint() == before
    assert (loader.epoch, loader.consumed) == (0, 0)


def test_naming_only_the_streams_the_dataset_draws_from_gives_the_same_samples() -> None:
    class TorchOnly(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 9

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.rand(2) + index

    every = detctx.elastic_loader(TorchOnly(), batch_size=4, seed=3, num_workers=2)
    named = detctx.elastic_loader(TorchOnly(), batch_size=4, seed=3, streams=["torch"])
    assert all(torch.equal(a, b) for a, b in zip(every, named))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_draw_from_a_stream_left_out_of_streams_is_refused_on_the_first_batch(
    workers: int,
) -> None:
    loader = detctx.elastic_loader(
        Indexed(6), batch_size=2, seed=3, streams=("torch", "numpy"), num_workers=workers
    )
    before = detctx.fingerprint()
    with pytest.raises(UndeclaredStreamError, match=r"drew from \['python'\].*'python'"):
        next(iter(loader))
    assert detctx.fingerprint() == before


@pytest.mark.slow
def test_the_loader_state_loads_with_weights_only_and_says_where_it_stands(
    tmp_path: Path,
) -> None:
    loader = detctx.elastic_loader(Indexed(10), batch_size=4, seed=3, num_workers=2)
    stream = iter(loader)
    next(stream)
    next(stream)
    torch.save({"detctx": detctx.resume_state(loader)}, tmp_path / "checkpoint.pt")
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["detctx"]
    assert state["loaders"] == [
        {
            "format": "detctx.elastic",
            "version": 2,
            "seed": 3,
            "shuffle": True,
            "length": 10,
            "epoch": 0,
            "consumed": 8,
        }
    ]
    assert [len(batch[0]) for batch in stream] == [2]  # the epoch's rest
    assert (loader.epoch, loader.consumed) == (1, 0)
    assert [len(batch[0]) for batch in loader] == [4, 4, 2]  # one iterator, one epoch
    assert (loader.epoch, loader.consumed) == (2, 0)


def test_a_bad_or_foreign_loader_state_is_refused_with_the_position_unchanged() -> None:
    loader = detctx.elastic_loader(Indexed(10), batch_size=4, seed=3)
    next(iter(loader))
    good = loader.state_dict()
    cases = [
        ({"format": "detctx.loader"}, "not an elastic loader state"),
        ({**good, "extra": 1}, "has entries"),
        ({**good, "version": 1}, "version 1: saved by a detctx that seeded each sample's"),
        ({**good, "version": 3}, "version 3"),
        ({**good, "version": True}, "version True"),
        # Crafted: a tensor was compared elementwise (RuntimeError), a float let through.
        ({**good, "version": torch.tensor([2, 2])}, r"version tensor\(\[2, 2\]\)"),
        ({**good, "version": torch.tensor(2)}, r"version tensor\(2\)"),
        ({**good, "version": 2.0}, "version 2.0"),
        ({**good, "shuffle": False}, "shuffle=False"),
        ({**good, "seed": 4}, "seed=4"),
        ({**good, "length": 11}, "11 samples"),
        ({**good, "consumed": 11}, "out of range"),
        ({**good, "consumed": -1}, "not an integer >= 0"),
        ({**good, "epoch": "1"}, "not an integer >= 0"),
        ({**good, "epoch": 2**40}, "out of range"),
        ([("format", "detctx.elastic")], "not an elastic loader state"),
    ]
    for state, message in cases:
        with pytest.raises(CheckpointError, match=message):
            loader.load_state_dict(state)
        assert loader.state_dict() == good
    # NumPy's integers are integers: a version of np.int64(2) is version 2.
    loader.load_state_dict({**good, "version": np.int64(2)})
    assert loader.state_dict() == good


def test_bad_loader_arguments_are_refused_when_it_is_built() -> None:
    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(3))

    dataset = Indexed(6)
    cases: list[tuple[type[Exception], str, Any, dict[str, Any]]] = [
        (TypeError, "IterableDataset", Stream(), {}),
        (ValueError, "1 to 2", Indexed(0), {}),
        (ValueError, "batch_size", dataset, {"batch_size": 0}),
        (ValueError, "batch_size", dataset, {"batch_size": True}),
        (TypeError, "seed must be an integer", dataset, {"seed": 1.5}),
        (TypeError, "shuffle", dataset, {"shuffle": 1}),
        (TypeError, "both rank= and world_size=", dataset, {"rank": 0}),
        (ValueError, "rank must be in", dataset, {"rank": 2, "world_size": 2}),
        (ValueError, "drop_last=True", dataset, {"rank": 0, "world_size": 2}),
        (ValueError, "every epoch would be empty", dataset, {"batch_size": 7, "drop_last": True}),
        (ValueError, "not registered", dataset, {"streams": ["torch", "cuda"]}),
        (TypeError, "sequence of source names", dataset, {"streams": "torch"}),
        (ValueError, "twice", dataset, {"streams": ["torch", "torch"]}),
        (TypeError, "collate_fn must be callable", dataset, {"collate_fn": 3}),
        (ValueError, "no sampler=", dataset, {"sampler": [0, 1]}),
        (ValueError, "no generator=", dataset, {"generator": torch.Generator()}),
        (ValueError, "no in_order=", dataset, {"num_workers": 2, "in_order": False}),
    ]
    for error, message, data, options in cases:
        arguments = {"batch_size": 2, "seed": 1, **options}
        with pytest.raises(error, match=message):
            detctx.elastic_loader(data, **arguments)


def test_the_order_and_the_sample_seeds_are_the_same_on_every_machine() -> None:
    # Pinned: the order comes from NumPy's legacy RandomState (frozen streams), the seeds
    # from SplitMix64's finaliser (64 bits; the order's from their high half, as before 64-bit
    # seeds); a change here changes every elastic run's samples.
    from detctx._basics import indexed_seed, indexed_seeds

    seeds = [3207296026000306913, 16184226688143867045, 13398859234004329862]
    assert indexed_seeds(7, [0, 1, 2]) == seeds
    assert [seed >> 32 for seed in seeds] == [746756798, 3768183916, 3119665019]
    assert indexed_seeds(2**32 - 1, [2**63 - 1]) == [11692203207427074754]
    assert [indexed_seed(7, index) for index in (0, 1, 2)] == indexed_seeds(7, [0, 1, 2])
    assert indexed_seed(2**32 - 1, 2**63 - 1) == 11692203207427074754
    loader = detctx.elastic_loader(Indexed(20), batch_size=6, seed=1234)
    assert next(iter(loader))[0].tolist() == [16, 19, 7, 8, 12, 0]


@settings(max_examples=200)
@given(st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40))
def test_one_seed_of_a_family_is_the_same_in_python_integers_as_in_numpy(
    base: int, indices: list[int]
) -> None:
    from detctx._basics import indexed_seed, indexed_seeds

    assert [indexed_seed(base, index) for index in indices] == indexed_seeds(base, indices)


def test_a_resume_with_a_larger_global_batch_and_nothing_left_of_the_epoch_starts_the_next() -> (
    None
):
    small = detctx.elastic_loader(Indexed(20), batch_size=6, seed=4, drop_last=True)
    stream = iter(small)
    next(stream)
    next(stream)
    state = small.state_dict()
    assert (state["epoch"], state["consumed"]) == (0, 12)
    large = detctx.elastic_loader(Indexed(20), batch_size=12, seed=4, drop_last=True)
    large.load_state_dict(state)  # 8 samples left, fewer than a batch of 12: dropped
    fresh = detctx.elastic_loader(Indexed(20), batch_size=12, seed=4, drop_last=True)
    fresh.set_epoch(1)
    assert next(iter(large))[0].tolist() == next(iter(fresh))[0].tolist()
    assert (large.epoch, large.consumed) == (2, 0)  # epoch 1 holds one batch of 12
