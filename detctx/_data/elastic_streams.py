"""Keyed streams for an elastic loader: what a sample looks like does not depend on who loads it.

A random augmentation in ``__getitem__`` draws from the global streams of the
process that runs it (a loader worker, or the main process), which stand
wherever earlier samples left them: sample ``i`` then looks different with
another ``num_workers``, another world size, or after a resume.
:class:`ElasticSamples` seeds the streams before each sample from
``(seed, epoch, index)``, and :class:`ElasticCollate` before each batch from
``(seed, epoch, the batch's first position in the epoch's order)``, through
:func:`detctx._data.keyed_collate.keyed_streams` (the transaction keyed
collation uses).

Fast, because a loader seeds every sample: a worker's streams are the
loader's alone and every draw that matters is seeded first, so a worker
seeds and never captures or restores; the main process (``num_workers=0``)
captures the caller's streams once per batch and puts them back after it.
Seeding costs about 10 us for Python's ``random``, 4 us for NumPy and 2 us
for torch's CPU generator; ``streams=`` names the ones the dataset draws
from, and the first batch each process loads checks that the others did
not move.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from detctx._basics import UndeclaredStreamError, derive_seed, indexed_seed
from detctx._data.keyed_collate import Sources, keyed_streams
from detctx._sources import registered_sources, registry_version
from detctx._state import Snapshot

__all__ = ["ElasticCollate", "ElasticSamples", "Keys", "SampleKey"]

SampleKey = tuple[int, int, int]
"""``(epoch, position in the epoch's order, index in the dataset)``: what the sampler hands
the dataset for each sample."""

_SAMPLE_KEY = 0x5A4D_0001
_COLLATE_KEY = 0x5A4D_0002


class Keys:
    """The seed and the streams of one elastic loader, and the seeds it derives.

    ``streams``: the names of the registered sources to seed (``None``: all of
    them, resolved in each process, so a worker started with ``spawn`` seeds
    what is registered there). Holds no source objects, so it pickles.
    """

    def __init__(self, seed: int, streams: tuple[str, ...] | None) -> None:
        self.seed = seed
        self.streams = streams
        self._bases: dict[tuple[int, int], int] = {}
        self._resolved: tuple[int, Sources, Sources] | None = None
        self._checked: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"seed": self.seed, "streams": self.streams}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["seed"], state["streams"])  # type: ignore[misc]

    def sample_base(self, epoch: int) -> int:
        """The base of ``epoch``'s sample seeds: sample ``i``'s is ``indexed_seed(base, i)``."""
        return self._base(_SAMPLE_KEY, epoch)

    def collate_seed(self, epoch: int, position: int) -> int:
        """The seed of the batch that starts at ``position`` of ``epoch``'s order."""
        return indexed_seed(self._base(_COLLATE_KEY, epoch), position)

    def _base(self, kind: int, epoch: int) -> int:
        base = self._bases.get((kind, epoch))
        if base is None:
            if len(self._bases) > 8:  # epochs only go forward: keep the last few
                self._bases.clear()
            base = self._bases[kind, epoch] = derive_seed(self.seed, kind, epoch)
        return base

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


class Batch(list[Any]):
    """The samples of one batch, with the batch's key for :class:`ElasticCollate`."""

    key: tuple[int, int]


class ElasticSamples(torch.utils.data.Dataset[Any]):
    """``dataset`` read by :data:`SampleKey`: each sample in streams seeded from its key.

    ``__getitems__`` (what a ``DataLoader`` calls for a batch) seeds before
    every sample inside one keyed world; ``__getitem__`` reads one sample
    the same way. Length and attributes are the wrapped dataset's.
    """

    def __init__(self, dataset: Any, keys: Keys) -> None:
        self.dataset = dataset
        self.keys = keys

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks; ``dataset`` is looked up in
        # __dict__, which is empty while unpickling.
        inner = self.__dict__.get("dataset")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __getitem__(self, key: SampleKey) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[SampleKey]) -> Batch:
        batch = Batch()
        if not keys:
            raise ValueError("an elastic batch needs at least one sample key")
        epoch, first, _ = keys[0]
        base = self.keys.sample_base(epoch)
        if any(key[0] != epoch for key in keys):
            raise ValueError(f"an elastic batch holds samples of more than one epoch: {keys}")
        with self.keys.world("dataset's __getitem__") as reseed:
            for _, _, index in keys:
                reseed(indexed_seed(base, index))
                batch.append(self.dataset[index])
        batch.key = (epoch, first)
        return batch


class ElasticCollate:
    """``collate(samples)`` in streams seeded from the batch's epoch and first position."""

    def __init__(self, collate: Callable[[list[Any]], Any], keys: Keys) -> None:
        self.collate = collate
        self.keys = keys

    def __call__(self, samples: Any) -> Any:
        key = getattr(samples, "key", None)
        if key is None:
            raise TypeError(
                "an elastic collate function takes the batches an elastic loader's dataset "
                f"returns (from __getitems__), not a {type(samples).__name__}: build the "
                "loader with detctx.elastic_loader"
            )
        epoch, position = key
        with self.keys.world("collate function") as reseed:
            reseed(self.keys.collate_seed(epoch, position))
            return self.collate(list(samples))

    def __repr__(self) -> str:
        return f"ElasticCollate({self.collate!r}, seed={self.keys.seed})"
