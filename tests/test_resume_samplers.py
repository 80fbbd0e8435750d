"""The samplers users pass to ``resumable_loader``: each resumes bit for bit, or is refused when the
loader is built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_resume import Shuffled
from torch.utils import data

import detctx

pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

SIZE = 14


def own(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def distributed(rank: int) -> data.DistributedSampler[Any]:
    return data.DistributedSampler(Shuffled(SIZE), num_replicas=2, rank=rank, seed=3)


# Each builds the loader's arguments afresh (a sampler holds its generator's position).
SAMPLERS: dict[str, Callable[[], dict[str, Any]]] = {
    "RandomSampler with its own generator": lambda: {
        "sampler": data.RandomSampler(Shuffled(SIZE), generator=own())
    },
    "RandomSampler with replacement": lambda: {
        "sampler": data.RandomSampler(
            Shuffled(SIZE), replacement=True, num_samples=40, generator=own()
        )
    },
    "SubsetRandomSampler": lambda: {
        "sampler": data.SubsetRandomSampler([1, 3, 4, 6, 8, 9, 11, 13], generator=own())
    },
    "WeightedRandomSampler": lambda: {
        "sampler": data.WeightedRandomSampler([1.0] * 7 + [3.0] * 7, 20, generator=own())
    },
    "DistributedSampler, rank 1 of 2": lambda: {"sampler": distributed(1)},
    "a BatchSampler around a RandomSampler": lambda: {
        "batch_sampler": data.BatchSampler(
            data.RandomSampler(Shuffled(SIZE), generator=own()), 3, drop_last=True
        )
    },
    "shuffle=True": lambda: {"shuffle": True},
}


def build(kind: str, workers: int = 0) -> Any:
    arguments = SAMPLERS[kind]()
    if "batch_sampler" not in arguments:
        arguments["batch_size"] = 3
    return detctx.resumable_loader(Shuffled(SIZE), num_workers=workers, seed=2, **arguments)


def epoch(loader: Any, number: int) -> list[float]:
    sampler = getattr(loader.sampler, "set_epoch", None)
    if sampler is not None:
        sampler(number)
    return [value for batch in loader for value in batch.flatten().tolist()]


def straight_and_resumed(kind: str, stop: int, workers: int = 0) -> tuple[list[float], ...]:
    """Three epochs straight; and stopped after ``stop`` batches of the second epoch (at most
    all but one), resumed in a new loader that serves the rest of it and the third."""
    with detctx.deterministic(seed=1):
        straight = build(kind, workers)
        expected = epoch(straight, 0) + epoch(straight, 1) + epoch(straight, 2)
    with detctx.deterministic(seed=1):
        first = build(kind, workers)
        served = epoch(first, 0)  # one whole epoch, then part of the next
        if hasattr(first.sampler, "set_epoch"):
            first.sampler.set_epoch(1)
        iterator = iter(first)
        batches = zip(range(min(stop, len(first) - 1)), iterator)
        served += [value for _, batch in batches for value in batch.flatten()]
        state = detctx.resume_state(first)
    with detctx.deterministic(seed=99):  # everything comes from the state
        second = build(kind, workers)
        detctx.resume(state, second)
        rest = [value for batch in second for value in batch.flatten().tolist()]
        rest += epoch(second, 2)
    return expected, [float(value) for value in served] + rest


@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_a_users_sampler_resumed_in_the_middle_of_an_epoch_continues_bit_for_bit(kind: str) -> None:
    expected, resumed = straight_and_resumed(kind, stop=2)
    assert resumed == expected


@pytest.mark.parametrize(
    "kind", ["RandomSampler with its own generator", "a BatchSampler around a RandomSampler"]
)
def test_with_two_workers_a_users_sampler_resumes_bit_for_bit(kind: str) -> None:
    expected, resumed = straight_and_resumed(kind, stop=1, workers=2)
    assert resumed == expected


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(sorted(SAMPLERS)), stop=st.integers(0, 6))
def test_stopping_a_users_sampler_after_any_batch_and_resuming_gives_the_same_batches(
    kind: str, stop: int
) -> None:
    expected, resumed = straight_and_resumed(kind, stop)
    assert resumed == expected


def test_without_detctx_a_users_random_sampler_resumes_into_other_batches() -> None:
    # The control: torchdata's loader skips the served samples of a fresh order, drawn
    # from the generator as it stands at the resume, not as it stood when the epoch began.
    from torchdata.stateful_dataloader import StatefulDataLoader

    def plain() -> Any:
        sampler = data.RandomSampler(Shuffled(SIZE), generator=own())
        return StatefulDataLoader(Shuffled(SIZE), batch_size=3, sampler=sampler)

    with detctx.deterministic(seed=1):
        straight = plain()
        list(straight)  # the first epoch
        iterator = iter(straight)
        next(iterator)
        state, streams = straight.state_dict(), detctx.capture()
        rest = [batch[:, 0].tolist() for batch in iterator]
    with detctx.deterministic(seed=1):
        resumed = plain()
        resumed.load_state_dict(state)
        streams.restore()
        assert [batch[:, 0].tolist() for batch in resumed] != rest


class Reversed(data.Sampler[int]):
    def __iter__(self) -> Any:
        return iter(range(SIZE - 1, -1, -1))

    def __len__(self) -> int:
        return SIZE


def test_a_sampler_whose_position_cannot_be_saved_is_refused_when_the_loader_is_built() -> None:
    loader_generator = own(1)
    refused: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"sampler": data.RandomSampler(Shuffled(SIZE))}, ValueError, "no generator of its own"),
        (
            {"sampler": data.SubsetRandomSampler([1, 2])},
            ValueError,
            "no generator of its own",
        ),
        (
            {
                "sampler": data.RandomSampler(Shuffled(SIZE), generator=loader_generator),
                "generator": loader_generator,
            },
            ValueError,
            "draws from the loader's generator",
        ),
        ({"sampler": Reversed()}, TypeError, "cannot save the position of a Reversed sampler"),
        (
            {"batch_sampler": [[0, 1], [2, 3]]},
            TypeError,
            "cannot save the position of a list batch sampler",
        ),
    ]
    from torchdata.stateful_dataloader.sampler import RandomSampler

    refused.append(
        (
            {
                "sampler": RandomSampler(
                    Shuffled(SIZE), replacement=True, generator=loader_generator
                ),
                "generator": loader_generator,
            },
            ValueError,
            "replacement=True",
        )
    )
    for arguments, error, message in refused:
        state = loader_generator.get_state()
        with pytest.raises(error, match=message):
            detctx.resumable_loader(Shuffled(SIZE), **arguments)
        assert torch.equal(loader_generator.get_state(), state)


def test_a_distributed_sampler_resumes_in_the_epoch_it_was_saved_in() -> None:
    # The epoch is part of the position: resume() puts it back, and a set_epoch to
    # another epoch before the first iter() is refused rather than served silently.
    with detctx.deterministic(seed=1):
        first = build("DistributedSampler, rank 1 of 2")
        first.sampler.set_epoch(4)
        next(iter(first))
        state = detctx.resume_state(first)
        second = build("DistributedSampler, rank 1 of 2")
        detctx.resume(state, second)
        assert second.sampler.epoch == 4
        second.sampler.set_epoch(0)
        with pytest.raises(detctx.CheckpointError, match=r"set_epoch\(0\)"):
            iter(second)
        second.sampler.set_epoch(4)
        assert len(list(second)) == 2  # the rest of rank 1's 7 samples in batches of 3
