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
Seeding costs about 8 us for Python's ``random``, 1.3 us for NumPy and 1 us
for torch's CPU generator; ``streams=`` names the ones the dataset draws
from, and the first batch each process loads checks that the others did
not move.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from detctx._basics import UndeclaredStreamError, derive_seed, indexed_seeds
from detctx._data.keyed_collate import Sources, keyed_streams
from detctx._data.wrapped import WrappedDataset
from detctx._sources import registered_sources, registry_version
from detctx._state import Snapshot

__all__ = ["ElasticCollate", "ElasticSamples", "Keys", "SampleKey"]

SampleKey = tuple[int, int, int]
"""``(epoch, position in the epoch's order, index in the dataset)``: what the sampler hands
the dataset for each sample."""

_EPOCH_KEY = 0x5A4D_0001
_COLLATE = 2**63
"""Where the collate seeds start in an epoch's family: no sample index reaches it."""


class Keys:
    """The seed and the streams of one elastic loader, and the seeds it derives.

    Epoch ``e``'s seeds are one family, ``indexed_seeds(derive_seed(seed, e),
    ...)``: sample ``i``'s at index ``i``, the collate seed of the batch that
    starts at position ``p`` at index ``2**63 + p``. ``streams``: the names of
    the registered sources to seed (``None``: all of them, resolved in each
    process, so a worker started with ``spawn`` seeds what is registered
    there). Holds no source objects, so it pickles.
    """

    def __init__(self, seed: int, streams: tuple[str, ...] | None) -> None:
        self.seed = seed
        self.streams = streams
        self._bases: dict[int, int] = {}
        self._resolved: tuple[int, Sources, Sources] | None = None
        self._checked: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"seed": self.seed, "streams": self.streams}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["seed"], state["streams"])  # type: ignore[misc]

    def seeds(self, epoch: int, indices: list[int], first: int) -> list[int]:
        """The seeds of samples ``indices`` of ``epoch``, then of the batch starting at
        position ``first`` (one call: about 6 us for a batch of 32)."""
        base = self._bases.get(epoch)
        if base is None:
            if len(self._bases) > 4:  # epochs only go forward: keep the last few
                self._bases.clear()
            base = self._bases[epoch] = derive_seed(self.seed, _EPOCH_KEY, epoch)
        return indexed_seeds(base, [*indices, _COLLATE + first])

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
        return self._resolved[1], self._resolved[2]

    @contextmanager
    def world(self, what: str) -> Iterator[Callable[[int], None]]:
        """A keyed world for one batch of ``what``: ``reseed(seed)`` seeds the chosen streams.

        In a loader worker nothing is put back; here the caller's streams are.
        The first time in this process, the streams left out are checked.
        """
        chosen, others = self.sources()
        in_worker = torch.utils.data.get_worker_info() is not None
        watched = others if others and what not in self._checked else []
        saved = Snapshot.capture(watched) if watched else None
        with keyed_streams(chosen, put_back=not in_worker) as reseed:
            yield reseed
        if saved is not None:
            before = saved.source_fingerprints()
            after = Snapshot.capture(watched).source_fingerprints()
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
        epoch, position, index = key
        with self.keys.world("dataset's __getitem__") as reseed:
            reseed(self.keys.seeds(epoch, [index], position)[0])
            return self.dataset[index]

    def __getitems__(self, keys: Sequence[SampleKey]) -> Collated:
        if not keys:
            raise ValueError("an elastic batch needs at least one sample key")
        epoch, first, _ = keys[0]
        if keys[-1][0] != epoch:  # the sampler's batches never span two epochs
            raise ValueError(f"an elastic batch holds samples of more than one epoch: {keys}")
        indices = [index for _, _, index in keys]
        seeds = self.keys.seeds(epoch, indices, first)
        dataset, samples = self.dataset, []
        # One world for the batch: a transaction, and the caller's streams captured and put
        # back, cost more than seeding a sample (about 30 us against 1 us for torch's).
        with self.keys.world("dataset's __getitem__ or the collate function") as reseed:
            for seed, index in zip(seeds, indices):
                reseed(seed)
                samples.append(dataset[index])
            reseed(seeds[-1])
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
