"""A resume state read from a checkpoint is untrusted: each crafted change is refused with nothing
changed, or (where it changes nothing that matters) resumes exactly."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_resume import Shuffled

import detctx
from detctx import CheckpointError

pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

Mutation = Callable[[dict[str, Any]], None]


def build(workers: int) -> Any:
    return detctx.resumable_loader(
        Shuffled(12), batch_size=4, shuffle=True, num_workers=workers, seed=3
    )


def values(batches: Any) -> list[float]:
    return [value for batch in batches for value in batch.flatten().tolist()]


def saved_after_one_batch(workers: int) -> tuple[dict[str, Any], list[float]]:
    """A state saved after the first batch, and what the straight run served after it."""
    with detctx.deterministic(seed=1):
        loader = build(workers)
        iterator = iter(loader)
        next(iterator)
        state = detctx.resume_state(loader)
        rest = values(iterator) + values(loader)
    return state, rest


def loader_part(state: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = state["loaders"][0]["loader"]
    return part


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = loader_part(state)["_snapshot"]
    return part


def main(state: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = snapshot(state)["_main_snapshot"]
    return part


def worker(state: dict[str, Any], index: int) -> dict[str, Any]:
    part: dict[str, Any] = snapshot(state)["_worker_snapshots"][f"worker_{index}"]
    return part


def setter(where: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: Any) -> Mutation:
    def mutate(state: dict[str, Any]) -> None:
        where(state)[key] = value

    return mutate


def samples(state: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = main(state)["_sampler_iter_state"]
    return part


def sampler_iterator(state: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = samples(state)["sampler_iter_state"]
    return part


def detctx_part(state: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = state["loaders"][0]
    return part


def worker_sources(index: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def where(state: dict[str, Any]) -> dict[str, Any]:
        part: dict[str, Any] = worker(state, index)["dataset_state"]["rng"]["sources"]
        return part

    return where


def invalid_mt19937() -> torch.Tensor:
    return torch.zeros(5056, dtype=torch.uint8)  # torch: RuntimeError('Invalid mt19937 state')


TWO_WORKERS: dict[str, Mutation] = {
    "samples_yielded=-5": setter(samples, "samples_yielded", -5),
    "samples_yielded past the epoch": setter(samples, "samples_yielded", 100),
    "samples_yielded as text": setter(samples, "samples_yielded", "4"),
    "samples_yielded as a bool": setter(samples, "samples_yielded", True),
    "samples_yielded off by one": setter(samples, "samples_yielded", 5),
    "a negative snapshot step": setter(snapshot, "_snapshot_step", -1),
    "a snapshot step past the epoch": setter(snapshot, "_snapshot_step", 99),
    "steps since the snapshot past the epoch": setter(loader_part, "_steps_since_snapshot", 5),
    "another last worker": setter(snapshot, "_last_yielded_worker_id", 1),
    "a last worker that does not exist": setter(snapshot, "_last_yielded_worker_id", 7),
    "three workers recorded": setter(main, "_num_workers", 3),
    "a negative base seed": setter(main, "_base_seed", -1),
    "a float base seed": setter(main, "_base_seed", 1.5),
    "another base seed": setter(main, "_base_seed", 12345),
    "the generator before the epoch from elsewhere": setter(
        detctx_part, "generator_before", torch.Generator().manual_seed(5).get_state()
    ),
    "batches drawn past the epoch": setter(main, "_sampler_iter_yielded", 99),
    "no worker snapshots": setter(snapshot, "_worker_snapshots", {}),
    "a worker's id swapped": setter(lambda state: worker(state, 0), "worker_id", 1),
    "a worker's dataset state gone": setter(lambda state: worker(state, 1), "dataset_state", None),
    "a worker's torch state invalid": setter(
        worker_sources(0), "torch", {"kind": "torch", "state": invalid_mt19937()}
    ),
    "a worker's torch state swapped for another valid one": setter(
        worker_sources(1),
        "torch",
        {"kind": "torch", "state": torch.Generator().manual_seed(8).get_state()},
    ),
    "the digest edited": setter(detctx_part, "digest", "0" * 32),
    "a worker's Python state cut": setter(
        worker_sources(1), "python", {"kind": "python", "state": {"version": 3}}
    ),
    "a worker's NumPy state gone": lambda state: worker_sources(0)(state).pop("numpy"),
    "the sampler's generator invalid": setter(sampler_iterator, "generator", invalid_mt19937()),
    "the sampler's yielded count off": setter(sampler_iterator, "yielded", 2),
    "finished in the middle of the epoch": setter(loader_part, "_iterator_finished", True),
    "finished as text": setter(loader_part, "_iterator_finished", "no"),
    "an empty loader position": setter(detctx_part, "loader", {}),
    "the loader generator invalid": setter(detctx_part, "generator", invalid_mt19937()),
    "the loader generator as floats": setter(detctx_part, "generator", torch.zeros(3)),
    "no loader generator": setter(detctx_part, "generator", None),
    "an empty configuration": setter(detctx_part, "config", {}),
    "an epoch for a sampler without one": setter(detctx_part, "epoch", 3),
    "a loader state of version 1": setter(detctx_part, "version", 1),
    "an extra entry": setter(detctx_part, "extra", 0),
    "the RNG states as a list": setter(lambda state: state, "rng", []),
    "no loaders": setter(lambda state: state, "loaders", {}),
}

NO_WORKERS: dict[str, Mutation] = {
    "batches served=-5": setter(loader_part, "_num_yielded", -5),
    "batches served past the epoch": setter(loader_part, "_num_yielded", 9),
    "batches drawn unlike batches served": setter(loader_part, "_sampler_iter_yielded", 2),
    "worker RNG states in the main process": setter(
        lambda state: loader_part(state)["dataset_state"], "rng", {"format": "detctx.RNGState"}
    ),
    "a fetcher state for a map-style dataset": setter(loader_part, "fetcher_state", {}),
    "a shared seed": setter(loader_part, "_shared_seed", 5),
    "a worker snapshot in a loader without workers": setter(loader_part, "_snapshot", {}),
}


def reordered(value: Any) -> Any:
    """``value`` with every dict's keys in reverse order and every tensor copied."""
    if isinstance(value, dict):
        return {key: reordered(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [reordered(item) for item in value]
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value


def assert_refused_with_nothing_changed(state: Any, *loaders: Any) -> str:
    before = detctx.fingerprint()
    generators = [loader.generator.get_state() for loader in loaders]
    with pytest.raises(CheckpointError) as refusal:
        detctx.resume(state, *loaders)
    assert detctx.fingerprint() == before
    for loader, generator in zip(loaders, generators):
        assert loader.next_iter_state is None
        assert torch.equal(loader.generator.get_state(), generator)
    return str(refusal.value)


@pytest.mark.parametrize("workers", [2, 0])
def test_every_crafted_change_of_a_saved_loader_state_is_refused_with_nothing_changed(
    workers: int,
) -> None:
    good, _ = saved_after_one_batch(workers)
    mutations = TWO_WORKERS if workers else NO_WORKERS
    refused = {}
    for name, mutate in mutations.items():
        state = copy.deepcopy(good)
        mutate(state)
        with detctx.deterministic(seed=1):
            refused[name] = assert_refused_with_nothing_changed(state, build(workers))
    assert len(refused) == len(mutations)
    # Each message names the entry or the setting that differs.
    assert "samples_yielded" in refused.get("samples_yielded=-5", "samples_yielded")
    assert "_num_yielded" in refused.get("batches served=-5", "_num_yielded")
    named = ("state['loaders'][0]", "the resume state")
    assert all(message.startswith(named) for message in refused.values()), refused


@pytest.mark.parametrize("workers", [2, 0])
def test_a_harmless_change_of_a_saved_state_resumes_exactly(workers: int) -> None:
    # Keys in another order and tensors that are copies: the same state.
    good, rest = saved_after_one_batch(workers)
    with detctx.deterministic(seed=99):
        loader = build(workers)
        detctx.resume(reordered(good), loader)
        assert values(loader) + values(loader) == rest


def test_a_loader_in_the_middle_of_an_epoch_or_passed_twice_is_refused() -> None:
    state, _ = saved_after_one_batch(0)
    with detctx.deterministic(seed=1):
        live = build(0)
        iterator = iter(live)
        next(iterator)
        message = assert_refused_with_nothing_changed(state, live)
        assert "middle of an epoch" in message
        assert len(values(iterator)) == 2 * 4 * 2  # it serves the rest of its epoch
        twice = build(0)
        two_states = {**state, "loaders": state["loaders"] * 2}
        message = assert_refused_with_nothing_changed(two_states, twice, twice)
        assert "the same loader is passed twice" in message


class FailingSource:
    """A registered RNG source whose restore raises while ``failing`` is set."""

    def __init__(self) -> None:
        self.value, self.failing = 0, False

    def capture(self) -> int:
        return self.value

    def restore(self, state: int) -> None:
        if self.failing:
            raise RuntimeError("the source's device is gone")
        self.value = state

    def seed(self, seed: int) -> None:
        self.value = seed


def test_when_a_source_fails_to_restore_inside_resume_the_loader_is_not_left_loaded() -> None:
    source = FailingSource()
    detctx.register_source("failing", source)
    try:
        state, _ = saved_after_one_batch(0)
        with detctx.deterministic(seed=1):
            loader = build(0)
            source.failing = True
            before = detctx.fingerprint()
            with pytest.raises(RuntimeError, match="device is gone"):
                detctx.resume(state, loader)
            source.failing = False
            assert detctx.fingerprint() == before
            assert loader.next_iter_state is None
    finally:
        detctx.unregister_source("failing")


def leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every value in ``value`` that is not a dict or a list."""
    if isinstance(value, dict):
        return [leaf for key in value for leaf in leaves(value[key], (*path, key))]
    if isinstance(value, list):
        return [leaf for index, item in enumerate(value) for leaf in leaves(item, (*path, index))]
    return [path]


REPLACEMENTS = st.one_of(
    st.integers(-3, 40),
    st.booleans(),
    st.none(),
    st.just("3"),
    st.just(torch.zeros(4, dtype=torch.uint8)),
    st.integers(0, 3).map(lambda seed: torch.Generator().manual_seed(seed).get_state()),
)
SAVED = {workers: saved_after_one_batch(workers) for workers in (0, 2)}


@settings(max_examples=80, deadline=None)
@given(data=st.data(), workers=st.sampled_from([0, 0, 0, 2]))
def test_any_value_of_a_saved_loader_state_replaced_is_refused_unchanged_or_resumes_exactly(
    data: st.DataObject, workers: int
) -> None:
    good, rest = SAVED[workers]
    state = copy.deepcopy(good)
    *path, last = data.draw(st.sampled_from(leaves(state["loaders"])), label="path")
    parent: Any = state["loaders"]
    for key in path:
        parent = parent[key]
    parent[last] = data.draw(REPLACEMENTS, label="value")
    with detctx.deterministic(seed=1):
        loader = build(workers)
        before = detctx.fingerprint()
        try:
            detctx.resume(state, loader)
        except CheckpointError:
            assert detctx.fingerprint() == before
            assert loader.next_iter_state is None
            return
        assert values(loader) + values(loader) == rest
