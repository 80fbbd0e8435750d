"""Every part of a resumable loader's state, checked against the live loader before anything loads.

A loader state is read from a checkpoint: untrusted. ``torchdata`` checks
almost none of it (some ``assert`` statements, gone under ``python -O``), and
what it does not check fails at the next ``iter()``, after the RNGs were
restored (``Invalid mt19937 state``, a dying worker, a bare
``StopIteration``), or loads and serves other data (``samples_yielded=-5``:
17 items in a 12-item epoch). So the state is walked here in full: the
configuration it was saved with (:func:`describe_loader`: workers, batch size,
``drop_last``, dataset length, sampler, rank and world size) must equal the
live loader's, and every count, flag, seed and RNG state of the position must
be one this loader can have produced, and the generator's draws of the
epoch, replayed, must lead from one saved generator state to the other
(:func:`check_draws`). Anything else raises :class:`~detctx.CheckpointError`
naming the entry and what it should be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch

from detctx._basics import CheckpointError
from detctx._data.samplers import (
    ReplayedSampler,
    describe_sampler,
    element_sampler,
    torchdata_samplers,
)
from detctx._data.untrusted import (
    count,
    entries,
    generator_state,
    keys_of,
    nothing,
    same_plain,
    shown,
)
from detctx._sources import registered_sources
from detctx._state import Snapshot

__all__ = [
    "check_configuration",
    "check_draws",
    "check_position",
    "describe_loader",
]

_SINGLE: Final = frozenset(
    {
        "_IterableDataset_len_called",
        "_index_sampler_state",
        "_iterator_finished",
        "_num_yielded",
        "_sampler_iter_state",
        "_sampler_iter_yielded",
        "_shared_seed",
        "dataset_state",
        "fetcher_state",
    }
)
_MULTI: Final = frozenset({"_iterator_finished", "_snapshot", "_steps_since_snapshot"})
_SNAPSHOT: Final = frozenset(
    {"_last_yielded_worker_id", "_main_snapshot", "_snapshot_step", "_worker_snapshots"}
)
_MAIN: Final = frozenset(
    {
        "_IterableDataset_len_called",
        "_base_seed",
        "_index_sampler_state",
        "_num_workers",
        "_sampler_iter_state",
        "_sampler_iter_yielded",
        "_shared_seed",
    }
)
_WORKER: Final = frozenset({"dataset_state", "fetcher_state", "worker_id"})
_SEED_LIMIT: Final = 2**63  # the base seed is a non-negative int64 drawn from the generator
_SETTINGS: Final = {
    "num_workers": "num_workers",
    "batch_size": "batch_size",
    "drop_last": "drop_last",
    "dataset_length": "the dataset's length",
    "batches": "batches per epoch",
    "sampler": "the sampler",
    "rank": "rank",
    "world_size": "world size",
}


def describe_loader(loader: Any, rank: int, world_size: int) -> dict[str, Any]:
    """What decides the batches ``loader`` serves and where, as plain data."""
    index = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    return {
        "num_workers": int(loader.num_workers),
        "batch_size": getattr(index, "batch_size", loader.batch_size),
        "drop_last": bool(getattr(index, "drop_last", loader.drop_last)),
        "dataset_length": len(loader.dataset),
        "batches": len(loader),
        "sampler": describe_sampler(element_sampler(loader)),
        "rank": rank,
        "world_size": world_size,
    }


def check_configuration(saved: Any, live: Mapping[str, Any], where: str) -> None:
    """Raise unless the configuration a state was saved with is ``live``; name each difference."""
    if not isinstance(saved, Mapping) or set(saved) != set(live):
        raise CheckpointError(
            f"{where}['config'] is not one a resumable loader saves "
            f"({keys_of(saved)}; expected {sorted(live)})"
        )
    differences = []
    for key, name in _SETTINGS.items():
        was, now = saved[key], live[key]
        if key == "sampler" and isinstance(was, Mapping) and not same_plain(was, now):
            fields = sorted(set(map(str, was)) | set(now))
            differences += [
                f"the sampler's {field} was {shown(was.get(field))}, is {now.get(field)!r} now"
                for field in fields
                if not same_plain(was.get(field), now.get(field))
            ]
        elif not same_plain(was, now):
            differences.append(f"{name} was {shown(was)}, is {now!r} now")
    if not differences:
        return
    if not same_plain(saved["world_size"], live["world_size"]):
        # The rank named here may have saved nothing (1 rank then, 2 now): say what to do.
        ranks = f"{shown(saved['world_size'])} rank" + (
            "" if same_plain(saved["world_size"], 1) else "s"
        )
        advice = (
            f"run on the {ranks} that saved it, each loading the state its own rank saved (a "
            "resumable loader's position belongs to its rank's share of the data); to go on "
            f"with {live['world_size']}, build the loader with detctx.elastic_loader, whose "
            "state resumes on another world size, or load the model and optimiser without "
            "detctx.resume and start a new epoch (the run then differs from one that never "
            "stopped)"
        )
    elif not same_plain(saved["rank"], live["rank"]):
        advice = (
            "each rank saves and resumes its own state, on as many ranks as saved it: load "
            f"the checkpoint rank {live['rank']} wrote (for example f'checkpoint.rank{{rank}}.pt')"
        )
    else:
        advice = (
            "build the loader as it was when the state was saved; to go on with this loader "
            "instead, load the model and optimiser without detctx.resume and start a new epoch "
            "(the run then differs from one that never stopped)"
        )
    raise CheckpointError(
        f"{where} does not fit this loader: {'; '.join(differences)}. To resume, {advice}"
    )


def check_position(loader: Any, state: Any, config: Mapping[str, Any], where: str) -> None:
    """Raise unless ``state`` (torchdata's part) is a position this loader can have reached."""
    batches: int = config["batches"]
    if loader.num_workers == 0:
        single = entries(state, where, _SINGLE)
        served = count(single["_num_yielded"], f"{where}._num_yielded", 0, batches)
        count(single["_sampler_iter_yielded"], f"{where}._sampler_iter_yielded", served, served)
        _finished(single["_iterator_finished"], f"{where}._iterator_finished", served, batches)
        nothing(single, where, ("_IterableDataset_len_called", "_shared_seed", "fetcher_state"))
        _dataset_state(loader, single["dataset_state"], f"{where}.dataset_state", in_worker=False)
        _sampler_states(loader, single, where, served, config)
        return
    outer = entries(state, where, _MULTI)
    snapshot = entries(outer["_snapshot"], f"{where}._snapshot", _SNAPSHOT)
    here = f"{where}._snapshot"
    step = count(snapshot["_snapshot_step"], f"{here}._snapshot_step", 0, batches)
    since = outer["_steps_since_snapshot"]
    since = count(since, f"{where}._steps_since_snapshot", 0, batches - step)
    _finished(outer["_iterator_finished"], f"{where}._iterator_finished", step + since, batches)
    workers = loader.num_workers
    last = snapshot["_last_yielded_worker_id"]
    # In order, worker k serves batches k, k + workers, ...; before any, the last is workers - 1.
    expected = (step - 1) % workers
    count(last, f"{here}._last_yielded_worker_id", expected, expected)
    main = entries(snapshot["_main_snapshot"], f"{here}._main_snapshot", _MAIN)
    at = f"{here}._main_snapshot"
    count(main["_num_workers"], f"{at}._num_workers", workers, workers)
    drawn = count(main["_sampler_iter_yielded"], f"{at}._sampler_iter_yielded", step, batches)
    count(main["_base_seed"], f"{at}._base_seed", 0, _SEED_LIMIT - 1)
    nothing(main, at, ("_IterableDataset_len_called", "_shared_seed"))
    _sampler_states(loader, main, at, drawn, config)
    keys = frozenset(f"worker_{index}" for index in range(workers))
    states = entries(snapshot["_worker_snapshots"], f"{here}._worker_snapshots", keys)
    for index in range(workers):
        path = f"{here}._worker_snapshots.worker_{index}"
        worker = entries(states[f"worker_{index}"], path, _WORKER)
        count(worker["worker_id"], f"{path}.worker_id", index, index)
        nothing(worker, path, ("fetcher_state",))
        _dataset_state(loader, worker["dataset_state"], f"{path}.dataset_state", in_worker=True)


def check_draws(loader: Any, state: Mapping[str, Any], where: str) -> None:
    """Raise unless the saved generator states and base seed follow from each other.

    A new epoch iterator draws from the loader's generator the order (when
    the sampler shares it: ``shuffle=True``), the workers' base seed and,
    with workers, the order once more (torch's iterator resets itself); an
    epoch of persistent workers after the first draws the order only. Replayed
    on a scratch generator from ``generator_before``, those draws must end at
    ``generator``, give the saved base seed and the sampler's saved start, or
    the state was edited or saved by another loader (another base seed: other
    data in the workers).
    """
    if loader.generator is None:
        return
    sampler = element_sampler(loader)
    shares = isinstance(sampler, torchdata_samplers().RandomSampler) and (
        sampler.generator is loader.generator
    )
    position, workers = state["loader"], loader.num_workers
    main = position if workers == 0 else position["_snapshot"]["_main_snapshot"]
    kinds = [True, False] if workers > 0 and loader.persistent_workers else [True]
    for new_iterator in kinds:
        scratch = torch.Generator()
        scratch.set_state(state["generator_before"])
        start, seed = scratch.get_state(), None
        if shares:
            torch.randperm(len(sampler.data_source), generator=scratch)
        if new_iterator:
            seed = int(torch.empty((), dtype=torch.int64).random_(generator=scratch).item())
            if shares and workers > 0:
                start = scratch.get_state()
                torch.randperm(len(sampler.data_source), generator=scratch)
        if torch.equal(state["generator"], scratch.get_state()):
            break
    else:
        if not shares and type(sampler).__module__.split(".")[0] not in ("torch", "torchdata"):
            # Lightning's DistributedSamplerWrapper (ddp, ddp_spawn, shuffle=True) draws each
            # epoch's order from the loader's generator at the epoch's first batch; torchdata
            # keeps only how many indices it yielded, so no resume can replay that order.
            raise CheckpointError(
                f"{where}: this loader's sampler is a {type(sampler).__name__}, which draws its "
                "order from the loader's generator in a way a resume cannot replay (Lightning "
                "wraps shuffle=True in a DistributedSamplerWrapper under ddp and ddp_spawn): "
                "give the loader sampler=torch.utils.data.DistributedSampler(dataset, "
                "shuffle=True, seed=...) instead of shuffle=True, or resume from a checkpoint "
                "saved at an epoch's end"
            )
        raise CheckpointError(
            f"{where}['generator'] does not follow from {where}['generator_before'] by this "
            "loader's draws (its order and the workers' base seed): the state was edited, or "
            "saved by a loader built differently"
        )
    if workers > 0 and seed is not None and main["_base_seed"] != seed:
        raise CheckpointError(
            f"{where}['loader']: the workers' base seed is {main['_base_seed']}; the saved "
            f"generator drew {seed} (the state was edited: other data in the workers)"
        )
    if shares:
        iterator = main["_sampler_iter_state"]
        if loader.batch_sampler is not None:
            iterator = iterator["sampler_iter_state"]
        if not torch.equal(iterator["generator"], start):
            raise CheckpointError(
                f"{where}: the sampler's epoch began from another generator state than the "
                "loader's draws give (the state was edited, or saved by a loader built "
                "differently)"
            )


def _sampler_states(
    loader: Any, state: Mapping[str, Any], where: str, drawn: int, config: Mapping[str, Any]
) -> None:
    """The index sampler's and its iterator's states after ``drawn`` batches were drawn."""
    batch_sampler = loader.batch_sampler
    index_state, iter_state = state["_index_sampler_state"], state["_sampler_iter_state"]
    if batch_sampler is None:  # no batching: the sampler's indices are the items
        _element_states(loader.sampler, index_state, iter_state, where, drawn)
        return
    if not isinstance(batch_sampler, torchdata_samplers().BatchSampler):
        return  # the user's own batch sampler, with a state of its own
    nothing(state, where, ("_index_sampler_state",))
    sampler = batch_sampler.sampler
    keys = {"samples_yielded"}
    if _stateful(sampler):
        keys.add("sampler_state")
    if _stateful_iterator(sampler):
        keys.add("sampler_iter_state")
    at = f"{where}._sampler_iter_state"
    # A user's stateful sampler may or may not have a stateful iterator.
    maybe = _stateful(sampler) and not isinstance(sampler, _known_stateful())
    optional = frozenset({"sampler_iter_state"} if maybe else ())
    parts = entries(iter_state, at, frozenset(keys), optional)
    total = config["sampler"]["length"]
    size = config["batch_size"]
    expected = min(drawn * size, total)
    samples = parts["samples_yielded"]
    ends = drawn == config["batches"] and type(samples) is int and samples == total
    if not ends:
        count(samples, f"{at}.samples_yielded", expected, expected)
    _element_states(
        sampler, parts.get("sampler_state"), parts.get("sampler_iter_state"), at, samples
    )


def _element_states(
    sampler: Any, sampler_state: Any, iter_state: Any, where: str, samples: int
) -> None:
    samplers = torchdata_samplers()
    if isinstance(sampler, samplers.StatefulDistributedSampler):
        parts = entries(sampler_state, f"{where}.sampler_state", frozenset({"yielded"}))
        count(parts["yielded"], f"{where}.sampler_state.yielded", samples, samples)
    elif isinstance(sampler, (samplers.RandomSampler, ReplayedSampler)):
        at = f"{where}.sampler_iter_state"
        parts = entries(iter_state, at, frozenset({"generator", "yielded"}))
        count(parts["yielded"], f"{at}.yielded", samples, samples)
        generator_state(parts["generator"], f"{at}.generator")


def _known_stateful() -> tuple[type[Any], ...]:
    return (torchdata_samplers().StatefulDistributedSampler,)


def _stateful(sampler: Any) -> bool:
    return callable(getattr(sampler, "state_dict", None)) and callable(
        getattr(sampler, "load_state_dict", None)
    )


def _stateful_iterator(sampler: Any) -> bool:
    return isinstance(sampler, (torchdata_samplers().RandomSampler, ReplayedSampler))


def _dataset_state(loader: Any, value: Any, where: str, *, in_worker: bool) -> None:
    parts = entries(value, where, frozenset({"dataset", "rng"}))
    inner = getattr(loader.dataset, "dataset", None)
    if not callable(getattr(inner, "state_dict", None)):
        nothing(parts, where, ("dataset",))
    if not in_worker:
        nothing(parts, where, ("rng",))
        return
    try:
        Snapshot.from_state_dict(parts["rng"], sources=list(registered_sources()))
    except CheckpointError as exc:
        raise CheckpointError(f"{where}.rng, a worker's RNG states: {exc}") from None
    except Exception as exc:  # untrusted data: whatever a source's check raised on it
        raise CheckpointError(f"{where}.rng is not a worker's RNG states ({exc!r})") from None


def _finished(value: Any, where: str, served: int, batches: int) -> None:
    if type(value) is not bool or (value and served != batches):
        raise CheckpointError(
            f"{where} is {shown(value)}; it is True only once all {batches} batches of the "
            f"epoch were served ({served} were)"
        )
