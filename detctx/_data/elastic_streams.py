"""Keyed streams for an elastic loader: what a sample looks like does not depend on who loads it.

A random augmentation in ``__getitem__`` draws from the global streams of the
process that runs it (a loader worker, or the main process), which stand
wherever earlier samples left them: sample ``i`` then looks different with
another ``num_workers``, another world size, or after a resume.
:class:`ElasticSamples` reads a batch in one keyed world
(:func:`detctx._data.keyed_collate.keyed_streams`, the transaction keyed
collation uses), seeding the streams before each sample from ``(seed,
epoch, index)`` and before collating from ``(seed, epoch, the batch's first
position in the epoch's order)``.

Fast, because a loader seeds every sample: a worker's streams are the
loader's alone and every draw that matters is seeded first, so a worker
seeds and never captures or restores; the main process (``num_workers=0``)
captures the caller's streams once per batch and puts them back after it.
Each seed has 64 bits and each stream gets all of them
(:func:`detctx._sources.seeder_of`): torch's CPU generator a whole state
built for the batch's seeds at once (``manual_seed`` keeps 32 bits), NumPy
both 32-bit words, Python's ``random`` the int. Seeding a sample costs about
8 us for Python's ``random`` (as with 32 bits), 6 times NumPy's 32-bit seeding
(its array path) and 2.7 times ``manual_seed`` for torch's CPU generator
(measured in batches of 33: docs/reliability.md);
``streams=`` names the ones the dataset draws from, and the first batch each
process loads checks that the others did not move.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from itertools import count, repeat
from typing import Any

import torch

from detctx._basics import UndeclaredStreamError, derive_seed, indexed_seed, indexed_seeds
from detctx._data.keyed_collate import KeyedStreams, Sources
from detctx._data.wrapped import WrappedDataset
from detctx._sources import registered_sources, registry_version
from detctx._state import Snapshot

__all__ = ["ElasticCollate", "ElasticSamples", "KeyBatch", "Keys", "SampleKey"]

SampleKey = tuple[int, int, int, int]
"""``(epoch, position in the epoch's order, index in the dataset, the sample's 64-bit seed)``."""


class KeyBatch:
    """The keys of one rank's batch: what the sampler hands the dataset for a batch.

    ``epoch``; ``first``, the position of its first sample in the epoch's
    order (the rest follow it); ``indices``, the samples' indices in the
    dataset; ``seeds``, their seeds, and ``collate_seed``, the batch's
    (:meth:`Keys.seeds`, derived by the sampler for many batches at a
    time). One object, not a tuple per sample: it crosses to a loader worker
    in one small pickle. Iterating it gives each sample's :data:`SampleKey`.
    """

    __slots__ = ("collate_seed", "epoch", "first", "indices", "seeds")

    def __init__(
        self, epoch: int, first: int, indices: list[int], seeds: list[int], collate_seed: int
    ) -> None:
        self.epoch = epoch
        self.first = first
        self.indices = indices
        self.seeds = seeds
        self.collate_seed = collate_seed

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[SampleKey]:
        return zip(repeat(self.epoch), count(self.first), self.indices, self.seeds)

    def __repr__(self) -> str:
        return (
            f"KeyBatch(epoch={self.epoch}, first={self.first}, indices={self.indices}, "
            f"seeds={self.seeds}, collate_seed={self.collate_seed})"
        )


_EPOCH_KEY = 0x5A4D_0001
_COLLATE = 2**63
"""Where the collate seeds start in an epoch's family: no sample index reaches it."""


class Keys:
    """The seed and the streams of one elastic loader, and the seeds it derives.

    Epoch ``e``'s seeds are one family, ``indexed_seeds(base(e), ...)`` with
    ``base(e) = indexed_seed(derive_seed(seed, KEY), e)``: sample ``i``'s at
    index ``i``, the collate seed of the batch that starts at position ``p``
    at index ``2**63 + p``. ``streams``: the names of
    the registered sources to seed (``None``: all of them, resolved in each
    process, so a worker started with ``spawn`` seeds what is registered
    there). Holds no source objects, so it pickles.
    """

    def __init__(self, seed: int, streams: tuple[str, ...] | None) -> None:
        self.seed = seed
        self.streams = streams
        # Epoch e's seeds are the family keyed by item e of this one (SeedSequence once,
        # SplitMix64 for each epoch: a SeedSequence costs about 16 us).
        self._family = derive_seed(seed, _EPOCH_KEY)
        self._resolved: tuple[int, Sources, Sources] | None = None
        self._checked: set[str] = set()
        # The keyed world of the chosen sources, by whether this is a loader worker.
        self._worlds: dict[bool, KeyedStreams] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"seed": self.seed, "streams": self.streams}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["seed"], state["streams"])  # type: ignore[misc]

    def base(self, epoch: int) -> int:
        """The key of ``epoch``'s family of seeds."""
        return indexed_seed(self._family, epoch)

    def seeds(self, epoch: int, indices: Any, firsts: list[int]) -> tuple[list[int], list[int]]:
        """The seeds of samples ``indices`` (an array of ints) of ``epoch``, in one NumPy call
        (about 8 us, and 5 ns more a seed), and of the batches that start at positions
        ``firsts``, in Python's integers (0.3 us each)."""
        base = self.base(epoch)
        collate = [indexed_seed(base, _COLLATE + first) for first in firsts]
        return indexed_seeds(base, indices), collate

    def sources(self) -> tuple[Sources, Sources]:
        """``(the sources to seed, the registered sources left out)`` in this process."""
        version = registry_version()
        if self._resolved is None or self._resolved[0] != version:
            registered = list(registered_sources())
            if self.streams is None:
                chosen, others = registered, []
            else:
                missing = set(self.streams) - {name for name, _ in registered}
                if missing:
                    raise UndeclaredStreamError(
                        f"streams={list(self.streams)} names {sorted(missing)}, which is not "
                        "registered in this process (a loader worker started with spawn or "
                        "forkserver sees only what its dataset's module registers): register "
                        "it there too, or use the fork start method"
                    )
                chosen = [(name, source) for name, source in registered if name in self.streams]
                others = [(name, source) for name, source in registered if name not in self.streams]
            self._resolved = (version, chosen, others)
            self._worlds.clear()
        return self._resolved[1], self._resolved[2]

    def world(self, what: str) -> AbstractContextManager[Callable[[int], object]]:
        """A keyed world for one batch of ``what``: ``reseed(seed)`` seeds the chosen streams.

        In a loader worker nothing is put back; here the caller's streams are.
        The first time in this process, the streams left out are checked.
        """
        _, others = self.sources()
        in_worker = torch.utils.data.get_worker_info() is not None
        world = self._world(in_worker)
        if others and what not in self._checked:
            return self._checked_world(what, world, others, in_worker)
        return world

    def prepare(self, seeds: list[int]) -> None:
        """Do ahead what seeding ``seeds`` needs, for the batch together (torch's states)."""
        self._world(torch.utils.data.get_worker_info() is not None).prepare(seeds)

    def _world(self, in_worker: bool) -> KeyedStreams:
        chosen, _ = self.sources()
        world = self._worlds.get(in_worker)
        if world is None:
            world = self._worlds[in_worker] = KeyedStreams(chosen, put_back=not in_worker)
        return world

    @contextmanager
    def _checked_world(
        self, what: str, world: KeyedStreams, others: Sources, in_worker: bool
    ) -> Iterator[Callable[[int], object]]:
        saved = Snapshot.capture(others)
        with world as reseed:
            yield reseed
        before = saved.source_fingerprints()
        after = Snapshot.capture(others).source_fingerprints()
        moved = sorted(name for name in before if before[name] != after[name])
        if moved:
            if not in_worker:
                saved.restore()
            raise UndeclaredStreamError(
                f"the {what} drew from {moved}, which streams={list(self.streams or ())} "
                "leaves out: those draws would depend on which worker or rank loaded the "
                f"sample. Pass streams={sorted({*(self.streams or ()), *moved})}, or "
                "streams=None for every registered stream"
            )
        self._checked.add(what)


class Collated:
    """A batch read and collated in one keyed world, on its way to :class:`ElasticCollate`."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class ElasticSamples(WrappedDataset):
    """``dataset`` read by :data:`SampleKey`: each sample in streams seeded from its key.

    ``__getitems__`` (what a ``DataLoader`` calls for a batch) reads every
    sample and collates them in one keyed world, seeding before each sample
    and before ``collate``; the ``DataLoader``'s ``collate_fn``
    (:class:`ElasticCollate`) hands the result on. ``__getitem__`` reads one
    sample the same way. Length and attributes are the wrapped dataset's.
    """

    def __init__(self, dataset: Any, keys: Keys, collate: Callable[[list[Any]], Any]) -> None:
        super().__init__(dataset)
        self.keys = keys
        self.collate = collate

    def __getitem__(self, key: SampleKey) -> Any:
        _, _, index, seed = key
        with self.keys.world("dataset's __getitem__") as reseed:
            reseed(seed)
            return self.dataset[index]

    def __getitems__(self, batch: KeyBatch) -> Collated:
        if not isinstance(batch, KeyBatch) or not batch.indices:
            raise ValueError(
                f"an elastic dataset reads batches of sample keys from an elastic loader's "
                f"sampler, got {batch!r}"
            )
        dataset, samples = self.dataset, []
        self.keys.prepare([*batch.seeds, batch.collate_seed])
        # One world for the batch: a transaction, and the caller's streams captured and put
        # back, cost more than seeding a sample (about 6 us against 1 us for torch's).
        with self.keys.world("dataset's __getitem__ or the collate function") as reseed:
            for index, seed in zip(batch.indices, batch.seeds):
                reseed(seed)
                samples.append(dataset[index])
            reseed(batch.collate_seed)
            return Collated(self.collate(samples))


class ElasticCollate:
    """The ``DataLoader``'s ``collate_fn``: hands on what :class:`ElasticSamples` collated.

    ``collate`` is the collate function it runs (for the record: frameworks read
    ``loader.collate_fn``).
    """

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, batch: Any) -> Any:
        if not isinstance(batch, Collated):
            raise TypeError(
                "an elastic collate function takes the batches an elastic loader's dataset "
                f"collates (in __getitems__), not a {type(batch).__name__}: build the loader "
                "with detctx.elastic_loader"
            )
        return batch.value

    def __repr__(self) -> str:
        return f"ElasticCollate({self.collate!r})"
