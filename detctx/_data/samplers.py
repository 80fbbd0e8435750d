"""The samplers a resumable loader takes: each resumes bit for bit, or is refused when it is built.

``torchdata``'s ``StatefulDataLoader`` resumes a sampler in one of two ways:
the sampler (or its iterator) has ``state_dict`` / ``load_state_dict``; or
it iterates the sampler afresh and skips the samples already
served. Skipping is exact only when a fresh iteration gives the epoch's
order again. torch's ``RandomSampler``, ``SubsetRandomSampler`` and
``WeightedRandomSampler`` with their own generator draw the order from that
generator when iterated, and the generator has moved on since the epoch
began, so the skipped order is another one. Reproduce (torchdata 0.11)::

    python -c "import torch; from torch.utils.data import RandomSampler
    from torchdata.stateful_dataloader import StatefulDataLoader as L
    g = torch.Generator().manual_seed(0)
    a = L(range(8), sampler=RandomSampler(range(8), generator=g))
    it = iter(a); next(it); s = a.state_dict(); rest = list(it)
    b = L(range(8), sampler=RandomSampler(range(8), generator=torch.Generator().manual_seed(0)))
    b.load_state_dict(s); print(rest == list(b))"                   # False

:class:`ReplayedSampler` wraps such a sampler: its iterator keeps the
generator state from just before the epoch's first draw and the number of
samples served, and on load puts that state back and replays the epoch up
to there, so the generator also ends the epoch where it did.
:func:`prepare_samplers` decides, from ``resumable_loader``'s arguments,
which sampler is replayed, which resumes as it is, and which is refused.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils import data

__all__ = [
    "ReplayedSampler",
    "describe_sampler",
    "element_sampler",
    "prepare_samplers",
    "torchdata_samplers",
]

# Samplers whose whole order comes from their ``generator`` when iterated.
_REPLAYED: tuple[type[Any], ...] = (
    data.RandomSampler,
    data.SubsetRandomSampler,
    data.WeightedRandomSampler,
)
# Samplers whose order is fixed by their attributes (DistributedSampler: seed and epoch).
_FIXED_ORDER: tuple[type[Any], ...] = (data.SequentialSampler, data.DistributedSampler)


class ReplayedSampler(data.Sampler[int]):
    """``sampler`` (which draws its order from ``sampler.generator``), resumable by replay.

    The indices are ``sampler``'s own, drawn from its generator exactly as
    without the wrapper; the original is ``.sampler``.
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[int]:
        return _ReplayIterator(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class _ReplayIterator(Iterator[int]):
    def __init__(self, sampler: Any) -> None:
        self._sampler = sampler
        # torch's samplers draw at their first next(), from the state read here (the
        # sampler's own generator: nothing else draws from it in between).
        self._start: torch.Tensor = sampler.generator.get_state()
        self._inner: Iterator[int] = iter(sampler)
        self._yielded = 0

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        index = next(self._inner)
        self._yielded += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._start, "yielded": self._yielded}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._start = state["generator"]
        self._sampler.generator.set_state(self._start)
        self._inner = iter(self._sampler)
        for _ in range(state["yielded"]):
            next(self._inner)
        self._yielded = state["yielded"]


def prepare_samplers(kwargs: dict[str, Any]) -> None:
    """Make ``resumable_loader``'s ``sampler=`` / ``batch_sampler=`` resumable, or refuse them.

    Rewrites ``kwargs`` in place; raises ``TypeError`` or ``ValueError``
    before anything is built for a sampler whose position cannot be saved.
    """
    generator = kwargs.get("generator")
    batch_sampler = kwargs.get("batch_sampler")
    if batch_sampler is not None:
        kwargs["batch_sampler"] = _prepare_batch_sampler(batch_sampler, generator)
    elif kwargs.get("sampler") is not None:
        kwargs["sampler"] = _prepare_sampler(kwargs["sampler"], generator)


def _prepare_batch_sampler(batch_sampler: Any, generator: Any) -> Any:
    if _is_stateful(batch_sampler):
        return batch_sampler
    if _plain(batch_sampler, data.BatchSampler):
        inner = _prepare_sampler(batch_sampler.sampler, generator)
        return torchdata_samplers().BatchSampler(
            inner, batch_sampler.batch_size, batch_sampler.drop_last
        )
    raise TypeError(
        f"resumable_loader cannot save the position of a {type(batch_sampler).__name__} batch "
        "sampler: use torch's BatchSampler(sampler, batch_size, drop_last), or give yours "
        "state_dict/load_state_dict that save and restore its position in the epoch"
    )


def _prepare_sampler(sampler: Any, loader_generator: Any) -> Any:
    if isinstance(sampler, torchdata_samplers().RandomSampler):
        if sampler.replacement and sampler.generator is loader_generator:
            raise ValueError(
                "this RandomSampler(replacement=True) draws from the loader's own generator as "
                "the epoch goes, between the loader's draws, which a resume cannot replay: give "
                "the sampler its own generator (generator=torch.Generator().manual_seed(s))"
            )
        return sampler
    if _is_stateful(sampler):
        return sampler
    if any(_plain(sampler, kind) for kind in _FIXED_ORDER):
        return sampler
    if any(_plain(sampler, kind) for kind in _REPLAYED):
        name = type(sampler).__name__
        own = getattr(sampler, "generator", None)
        if not isinstance(own, torch.Generator) or own.device.type != "cpu":
            raise ValueError(
                f"this {name} has no generator of its own, so each epoch's order is drawn from "
                "torch's global stream and no saved position replays it: pass "
                f"{name}(..., generator=torch.Generator().manual_seed(s)), or shuffle=True"
            )
        if own is loader_generator:
            raise ValueError(
                f"this {name} draws from the loader's generator, which also draws the workers' "
                f"seeds, so a resume cannot replay its order: give the {name} a generator of "
                "its own (generator=torch.Generator().manual_seed(s))"
            )
        return ReplayedSampler(sampler)
    raise TypeError(
        f"resumable_loader cannot save the position of a {type(sampler).__name__} sampler: use "
        "shuffle=True, torch's RandomSampler / SubsetRandomSampler / WeightedRandomSampler with "
        "a generator, a DistributedSampler or a SequentialSampler, or give yours "
        "state_dict/load_state_dict that save and restore its position in the epoch"
    )


def torchdata_samplers() -> Any:
    """``torchdata.stateful_dataloader.sampler`` (imported when a resumable loader is built)."""
    return importlib.import_module("torchdata.stateful_dataloader.sampler")


def _plain(sampler: Any, kind: type[Any]) -> bool:
    """``sampler`` is a ``kind`` that iterates as ``kind`` does."""
    return isinstance(sampler, kind) and type(sampler).__iter__ is kind.__iter__


def _is_stateful(sampler: Any) -> bool:
    return callable(getattr(sampler, "state_dict", None)) and callable(
        getattr(sampler, "load_state_dict", None)
    )


def element_sampler(loader: Any) -> Any:
    """The sampler of indices behind ``loader``'s batches (inside a replay, the user's)."""
    sampler = getattr(loader.batch_sampler, "sampler", None) or loader.sampler
    return sampler.sampler if isinstance(sampler, ReplayedSampler) else sampler


def describe_sampler(sampler: Any) -> dict[str, Any]:
    """What decides ``sampler``'s order, as plain data: two equal descriptions, one order."""
    kind = type(sampler)
    described: dict[str, Any] = {"kind": f"{kind.__module__}.{kind.__qualname__}"}
    for attribute in ("replacement", "num_replicas", "rank", "shuffle", "seed", "drop_last"):
        value = getattr(sampler, attribute, None)
        if isinstance(value, (bool, int)):
            described[attribute] = value
    try:
        described["length"] = len(sampler)
    except TypeError:
        described["length"] = None
    if isinstance(sampler, data.SubsetRandomSampler):
        described["indices"] = _digest(np.asarray(list(sampler.indices), dtype=np.int64))
    if isinstance(sampler, data.WeightedRandomSampler):
        described["weights"] = _digest(sampler.weights.detach().cpu().numpy())
    return described


def _digest(values: Any) -> str:
    return f"{zlib.crc32(np.ascontiguousarray(values).tobytes()):08x}"
