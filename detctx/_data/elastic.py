"""Elastic determinism: resume on another number of loader workers or ranks.

:func:`elastic_loader` makes what each sample looks like independent of who
loads it:

- the epoch's order is a permutation drawn from ``(seed, epoch)`` alone
  (NumPy's legacy ``RandomState``, whose streams NumPy keeps frozen across
  releases);
- each sample is read in streams seeded from ``(seed, epoch, index)`` and
  each batch collated in streams seeded from ``(seed, epoch, the batch's
  first position)`` (:mod:`detctx._data.elastic_streams`);
- the position is one number, the samples consumed globally in the epoch.
  A global batch is ``world_size * batch_size`` consecutive positions of the
  order, and rank ``r`` takes the contiguous part
  ``[r * batch_size, (r + 1) * batch_size)`` of it, so concatenating the
  ranks' batches of a step in rank order gives the order itself.

Resuming is skipping to the consumed count, with any ``num_workers``, and
with any world size that keeps the global batch (``world_size *
batch_size``): see docs/resume.md, "Elastic resume".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import torch

from detctx._basics import CheckpointError, as_integer, validate_seed
from detctx._data.elastic_order import ElasticBatches, Position
from detctx._data.elastic_streams import ElasticCollate, ElasticSamples, Keys
from detctx._data.keyed_collate import KEYED_STREAMS_VERSION
from detctx._sources import registered_sources

__all__ = ["ELASTIC_FORMAT", "ElasticLoader", "elastic_loader"]

ELASTIC_FORMAT: Final = "detctx.elastic"
"""The ``"format"`` entry of an elastic loader's ``state_dict()``."""

_VERSION: Final = KEYED_STREAMS_VERSION
"""A state's version is how its samples' streams were seeded: a position means the same
augmentation only in the same derivation (version 1: 32-bit seeds)."""
_STATE_KEYS: Final = frozenset(
    {"format", "version", "seed", "shuffle", "length", "epoch", "consumed"}
)
_REFUSED: Final = {
    "sampler": "the order comes from seed and the epoch",
    "batch_sampler": "the batches come from batch_size, rank and world_size",
    "generator": "the order comes from seed and the epoch",
    "in_order": "batches must arrive in order for the position to mean anything",
}


class ElasticLoader:
    """A loader whose batches do not depend on ``num_workers``, and whose position is one number.

    Built by :func:`elastic_loader`. Iterating it continues the current
    epoch from its position (a new loader: epoch 0 from the start); the
    epoch's last batch moves the position to the next epoch's start, so
    ``loader.epoch`` is the epoch of the next batch and one iterator is one
    epoch, or the rest of one.
    ``state_dict()`` is ``{"format": "detctx.elastic", "version": 2, "seed",
    "shuffle", "length", "epoch", "consumed"}`` (plain ints, bools and
    strings); ``load_state_dict()`` checks every entry first. Attributes a
    ``DataLoader`` has (``dataset``, ``batch_sampler``, ``collate_fn``,
    ``num_workers``...) are the inner ``DataLoader``'s, so accelerate's
    ``skip_first_batches`` (Hugging Face ``Trainer``'s resume) rebuilds it.
    """

    def __init__(self, loader: torch.utils.data.DataLoader[Any], batches: ElasticBatches) -> None:
        self.loader = loader
        self.batches = batches
        self.position = batches.position

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.position.epoch

    @property
    def consumed(self) -> int:
        """Samples of this epoch consumed so far, over every rank."""
        return self.position.consumed

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (the current epoch keeps its position)."""
        self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        position = self.position
        if self.batches.end(position.consumed) == position.consumed:
            # Nothing left of this epoch (a resume with a larger global batch and
            # drop_last): this iterator is the next epoch's.
            position.move_to(position.epoch + 1, 0)
        position.generation += 1
        generation, epoch, after = position.generation, position.epoch, position.consumed
        end, step = self.batches.end(after), self.batches.global_batch
        for batch in self.loader:
            if position.generation != generation:
                return  # the position was set anew: this iterator is stale
            after = min(after + step, end)
            # The last batch of an epoch moves the position to the next epoch's start, as
            # frameworks (Lightning, the Trainer) make one iterator per epoch and stop
            # after len(loader) batches, without asking for the end.
            if after == end:
                position.epoch, position.consumed = epoch + 1, 0
            else:
                position.consumed = after
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The position, with what it is a position in (seed, order, dataset length)."""
        return {
            "format": ELASTIC_FORMAT,
            "version": _VERSION,
            "seed": self.batches.seed,
            "shuffle": self.batches.shuffle,
            "length": self.batches.length,
            "epoch": self.position.epoch,
            "consumed": self.position.consumed,
        }

    def check_state(self, state: Any, where: str = "the elastic loader state") -> None:
        """Raise :class:`~detctx.CheckpointError` unless ``state`` is a position in this loader's
        order (the same seed, shuffling and dataset length)."""
        if not isinstance(state, Mapping) or state.get("format") != ELASTIC_FORMAT:
            raise CheckpointError(
                f"{where} is not an elastic loader state (no 'format': {ELASTIC_FORMAT!r} "
                "entry): pass what an elastic loader's state_dict() returned, to the elastic "
                "loader it was saved from"
            )
        if set(state) != _STATE_KEYS:
            raise CheckpointError(
                f"the elastic loader state has entries {sorted(map(str, state))}; expected "
                f"{sorted(_STATE_KEYS)}"
            )
        # An integer, Python's or NumPy's: a tensor here would be compared elementwise.
        version = as_integer(state["version"])
        if version == 1:
            raise CheckpointError(
                "the elastic loader state is version 1: saved by a detctx that seeded each "
                "sample's streams from 32 bits (two samples could draw the same augmentation); "
                f"this one seeds them from 64 bits, so the rest of the epoch would not be the "
                "saved run's. Resume with the detctx that saved it, or, to go on with other "
                "augmentation from here, load the position as this version's: "
                f'loader.load_state_dict({{**state, "version": {_VERSION}}})'
            )
        if version != _VERSION:
            raise CheckpointError(
                f"the elastic loader state has version {state['version']!r}; this detctx reads "
                f"version {_VERSION}"
            )
        if not isinstance(state["shuffle"], bool) or state["shuffle"] != self.batches.shuffle:
            raise CheckpointError(
                f"the elastic loader state was saved with shuffle={state['shuffle']!r}, this "
                f"loader has shuffle={self.batches.shuffle}: the orders differ"
            )
        fields = {name: as_integer(state[name]) for name in ("seed", "length", "epoch", "consumed")}
        for name, value in fields.items():
            if value is None or value < 0:
                raise CheckpointError(
                    f"the elastic loader state's {name!r} is {state[name]!r}, not an integer >= 0"
                )
        if fields["seed"] != self.batches.seed:
            raise CheckpointError(
                f"the elastic loader state was saved with seed={fields['seed']}, this loader has "
                f"seed={self.batches.seed}: build the loader with the seed of the saved run"
            )
        if fields["length"] != self.batches.length:
            raise CheckpointError(
                f"the elastic loader state is a position in a dataset of {fields['length']} "
                f"samples; this loader's has {self.batches.length}: resume with the same dataset"
            )
        if fields["epoch"] > 2**32 - 1 or fields["consumed"] > self.batches.length:  # type: ignore[operator]
            raise CheckpointError(
                f"the elastic loader state's position (epoch {fields['epoch']}, consumed "
                f"{fields['consumed']}) is out of range for {self.batches.length} samples"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter()``; nothing changes if it is refused."""
        self.check_state(state)
        self.load_checked(state)

    def load_checked(self, state: Mapping[str, Any]) -> None:
        """Load a state :meth:`check_state` accepted."""
        self.position.move_to(int(state["epoch"]), int(state["consumed"]))

    def pending(self) -> tuple[int, int, int]:
        """What a load changes, for :meth:`put_back`."""
        position = self.position
        return position.epoch, position.consumed, position.generation

    def put_back(self, before: tuple[int, int, int]) -> None:
        """Undo a load: what :meth:`pending` returned before it (a live iterator goes on)."""
        position = self.position
        position.epoch, position.consumed, position.generation = before

    def __repr__(self) -> str:
        b = self.batches
        return (
            f"ElasticLoader(length={b.length}, batch_size={b.batch_size}, rank={b.rank}, "
            f"world_size={b.world_size}, seed={b.seed}, epoch={self.epoch}, "
            f"consumed={self.consumed})"
        )


def elastic_loader(
    dataset: Any,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    drop_last: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    streams: Sequence[str] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    **loader_options: Any,
) -> ElasticLoader:
    """A loader whose samples and batches are the same whoever loads them: resume anywhere.

    ``dataset`` is map-style. Every sample's ``__getitem__`` runs in streams
    seeded from ``(seed, epoch, index)``, and ``collate_fn`` (default:
    ``torch.utils.data.default_collate``) in streams seeded from ``(seed,
    epoch, the batch's first position)``: Python's ``random``, NumPy's global
    generator, torch's CPU generator and the registered sources, or only the
    ones ``streams`` names (faster; the first batch each process loads checks
    the others did not move, :class:`~detctx.UndeclaredStreamError`). In the
    main process the caller's streams are put back after each batch.

    The epoch's order comes from ``(seed, epoch)``. Each step takes a global
    batch of ``world_size * batch_size`` samples; rank ``rank`` takes the
    contiguous part ``[rank * batch_size, (rank + 1) * batch_size)``.
    ``rank`` and ``world_size`` default to the initialised process group's,
    else 0 and 1; with more than one rank ``drop_last=True`` is required (a
    partial global batch would give ranks different numbers of steps).
    ``loader_options`` go to the inner ``DataLoader`` (``num_workers``,
    ``pin_memory``, ``persistent_workers``...)::

        loader = detctx.elastic_loader(dataset, batch_size=32, seed=1234, num_workers=4)
        torch.save({"model": ..., "detctx": detctx.resume_state(loader)}, path)
        # later, with num_workers=8 or on another number of ranks:
        detctx.resume(torch.load(path, weights_only=True)["detctx"], loader)

    Bad arguments raise ``TypeError`` or ``ValueError`` here, before anything
    is built.
    """
    seed = validate_seed(seed)
    size = as_integer(batch_size)
    if size is None or size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    length = _length(dataset)
    rank, world_size = _layout(rank, world_size)
    if world_size > 1 and not drop_last:
        raise ValueError(
            f"with {world_size} ranks pass drop_last=True: a last global batch smaller than "
            f"world_size * batch_size would leave some ranks without a batch, and a "
            "collective waiting for them"
        )
    if drop_last and length < size * world_size:
        raise ValueError(
            f"with drop_last=True a dataset of {length} samples has no whole global batch of "
            f"world_size * batch_size = {size * world_size}: every epoch would be empty"
        )
    chosen = _streams(streams)
    if collate_fn is None:
        collate_fn = torch.utils.data.default_collate
    elif not callable(collate_fn):
        raise TypeError(f"collate_fn must be callable, got {type(collate_fn).__name__}")
    for name, why in _REFUSED.items():
        harmless = True if name == "in_order" else None
        if loader_options.pop(name, harmless) is not harmless:
            raise ValueError(f"elastic_loader takes no {name}=: {why}")
    keys = Keys(seed, chosen)
    batches = ElasticBatches(
        length,
        seed=seed,
        batch_size=size,
        shuffle=shuffle,
        drop_last=drop_last,
        rank=rank,
        world_size=world_size,
        position=Position(),
        keys=keys,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        loader = torch.utils.data.DataLoader(
            ElasticSamples(dataset, keys, collate_fn),
            # Its batches are KeyBatch objects, not lists: the DataLoader hands each, as it
            # is, to the dataset's __getitems__ (in a worker, after one small pickle).
            batch_sampler=batches,  # type: ignore[arg-type]
            collate_fn=ElasticCollate(collate_fn),
            # Its own generator: every DataLoader iterator draws a base seed for its workers,
            # from torch's global stream when it has none, and a resumed run makes one
            # iterator more than the straight run (the keyed streams make the draw moot).
            generator=torch.Generator().manual_seed(seed),
            **loader_options,
        )
    return ElasticLoader(loader, batches)


def _length(dataset: Any) -> int:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError(
            f"elastic_loader takes a map-style dataset; {type(dataset).__name__} is an "
            "IterableDataset, whose order only the dataset itself knows"
        )
    if not callable(getattr(dataset, "__getitem__", None)):
        raise TypeError(
            f"elastic_loader takes a map-style dataset, got {type(dataset).__name__} "
            "(no __getitem__)"
        )
    try:
        length = len(dataset)
    except TypeError:
        raise TypeError(
            f"elastic_loader needs the dataset's length; {type(dataset).__name__} has no __len__"
        ) from None
    if length < 1 or length >= 2**63:
        raise ValueError(f"elastic_loader needs a dataset of 1 to 2**63 - 1 samples, got {length}")
    return int(length)


def _layout(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if (rank is None) != (world_size is None):
        raise TypeError("pass both rank= and world_size=, or neither (the process group's)")
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
        return 0, 1
    rank = validate_seed(rank, "rank")
    size = as_integer(world_size)
    if size is None or size < 1 or rank >= size:
        raise ValueError(
            f"rank must be in [0, world_size), got rank={rank}, world_size={world_size!r}"
        )
    return rank, size


def _streams(streams: Sequence[str] | None) -> tuple[str, ...] | None:
    if streams is None:
        return None
    if isinstance(streams, str) or not all(isinstance(name, str) for name in streams):
        raise TypeError(
            f"streams must be a sequence of source names, such as ('torch', 'numpy'), "
            f"got {streams!r}"
        )
    registered = [name for name, _ in registered_sources()]
    unknown = sorted(set(streams) - set(registered))
    if unknown:
        raise ValueError(
            f"streams names {unknown}, which are not registered; registered: {registered}"
        )
    if len(set(streams)) != len(streams):
        raise ValueError(f"streams names a source twice: {list(streams)}")
    return tuple(streams)
