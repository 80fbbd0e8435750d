"""Resume anywhere: a loader's position and the RNGs in one state, and a resumed loader serves the
batches the straight one did (the loops in fresh processes are in test_resume_matrix.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_python
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx
from detctx import CheckpointError

pytest.importorskip("torchdata.stateful_dataloader")


class Shuffled(torch.utils.data.Dataset[torch.Tensor]):
    """``size`` items, each with a fresh torch draw: the batches show order and streams."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), torch.rand(()).item()])


def epochs(loader: Any, count: int) -> list[list[float]]:
    return [[value for batch in loader for value in batch.flatten().tolist()] for _ in range(count)]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_after_a_resume_the_next_epochs_shuffle_as_in_the_straight_run() -> None:
    # torchdata's own loader rewinds its generator to the epoch's start on load, so
    # the epoch after a resume is shuffled differently; resumable_loader's is not.
    from torchdata.stateful_dataloader import StatefulDataLoader

    def plain() -> Any:
        return StatefulDataLoader(
            Shuffled(8), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0)
        )

    def resumable() -> Any:
        return detctx.resumable_loader(Shuffled(8), batch_size=2, shuffle=True, seed=0)

    for build, same in ((plain, False), (resumable, True)):
        with detctx.deterministic(seed=1):
            straight = build()
            iterator = iter(straight)
            next(iterator)
            state, streams = straight.state_dict(), detctx.capture()
            rest = [value for batch in iterator for value in batch.flatten().tolist()]
            following = epochs(straight, 2)
        with detctx.deterministic(seed=1):
            resumed = build()
            resumed.load_state_dict(state)
            streams.restore()
            resumed_rest = epochs(resumed, 1)[0]
            assert resumed_rest == rest
            assert (epochs(resumed, 2) == following) is same


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(size=st.integers(3, 12), batch=st.integers(1, 4), stop=st.integers(0, 20))
def test_stopping_after_any_batch_and_resuming_gives_the_same_batches(
    size: int, batch: int, stop: int
) -> None:
    full_epochs = stop // -(-size // batch)  # those the first run completed
    with detctx.deterministic(seed=5):
        straight = detctx.resumable_loader(Shuffled(size), batch_size=batch, shuffle=True)
        expected = [value for epoch in epochs(straight, full_epochs + 3) for value in epoch]
    with detctx.deterministic(seed=5):
        first = detctx.resumable_loader(Shuffled(size), batch_size=batch, shuffle=True)
        seen: list[float] = []
        iterator = iter(first)
        for _ in range(stop):
            try:
                seen += next(iterator).flatten().tolist()
            except StopIteration:
                iterator = iter(first)
                seen += next(iterator).flatten().tolist()
        state = detctx.resume_state(first)
    with detctx.deterministic(seed=99):  # another seed: everything comes from the state
        second = detctx.resumable_loader(Shuffled(size), batch_size=batch, shuffle=True, seed=5)
        detctx.resume(state, second)
        # The rest of the epoch it stopped in (maybe nothing), then two more.
        rest = [value for epoch in epochs(second, 3) for value in epoch]
    assert len(rest) >= 2 * 2 * size  # two values per item, two epochs at least
    assert seen + rest == expected[: len(seen) + len(rest)]


def test_the_resume_state_loads_with_weights_only(tmp_path: Path) -> None:
    loader = detctx.resumable_loader(Shuffled(6), batch_size=2, shuffle=True, num_workers=2)
    next(iter(loader))
    torch.save({"detctx": detctx.resume_state(loader)}, tmp_path / "checkpoint.pt")
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["detctx"]
    assert state["format"] == "detctx.resume" and len(state["loaders"]) == 1


def test_a_bad_resume_state_is_refused_with_nothing_changed() -> None:
    loader = detctx.resumable_loader(Shuffled(6), batch_size=2, shuffle=True)
    good = detctx.resume_state(loader)
    corrupted_rng = {**good, "rng": {**good["rng"], "sources": {}}}
    foreign_loader = {**good, "loaders": [{"_num_yielded": 1}]}
    cases = [
        ({"format": "something else"}, (loader,), "not a detctx resume state"),
        ({**good, "version": 4}, (loader,), "version 4"),
        (good, (), "1 loader state"),
        (corrupted_rng, (loader,), "no state for source"),
        (foreign_loader, (loader,), "not saved by a detctx resumable loader"),
    ]
    for state, loaders, message in cases:
        before = detctx.fingerprint()
        with pytest.raises(CheckpointError, match=message):
            detctx.resume(state, *loaders)
        assert detctx.fingerprint() == before
        assert loader.next_iter_state is None


def test_bad_loader_arguments_are_refused_when_it_is_built() -> None:
    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(3))

    with pytest.raises(TypeError, match="IterableDataset"):
        detctx.resumable_loader(Stream())
    with pytest.raises(ValueError, match="in_order=True"):
        detctx.resumable_loader(Shuffled(4), num_workers=2, in_order=False)
    with pytest.raises(TypeError, match="either seed= or generator="):
        detctx.resumable_loader(Shuffled(4), seed=1, generator=torch.Generator())
    with pytest.raises(TypeError, match="resumable_loader"):
        detctx.resume_state(torch.utils.data.DataLoader(Shuffled(4)))


@pytest.mark.slow
def test_without_torchdata_the_error_names_the_extra() -> None:
    out = run_python(
        """
        import sys
        sys.modules["torchdata"] = None
        import detctx
        try:
            detctx.resumable_loader(list(range(4)))
        except detctx.MissingDependencyError as exc:
            print(exc)
        """
    )
    assert "pip install 'detctx[resume]'" in out


def test_a_keyed_collator_draws_by_batch_and_leaves_the_callers_streams_alone() -> None:
    from detctx.integrations.transformers import DeterministicCallback

    def mask(features: list[list[int]]) -> torch.Tensor:
        return torch.bernoulli(torch.full((len(features), len(features[0])), 0.5))

    collate = torch.utils.data.DataLoader([[1, 2, 3]] * 4, batch_size=2, collate_fn=mask)
    callback = DeterministicCallback()

    class Arguments:
        seed, dataloader_persistent_workers = 7, False

    callback.on_train_begin(Arguments(), None, None, train_dataloader=collate)
    keyed = collate.collate_fn
    before = detctx.fingerprint()
    first, again = keyed([[1, 2, 3]] * 4), keyed([[1, 2, 3]] * 4)
    other = keyed([[1, 2, 4]] * 4)
    assert detctx.fingerprint() == before
    assert torch.equal(first, again) and not torch.equal(first, other)

    unchanged = torch.utils.data.DataLoader([[1]], collate_fn=mask)
    DeterministicCallback(resumable=False).on_train_begin(
        Arguments(), None, None, train_dataloader=unchanged
    )
    assert unchanged.collate_fn is mask
    with pytest.raises(TypeError, match="resumable must be True or False"):
        DeterministicCallback(resumable="yes")  # type: ignore[arg-type]
