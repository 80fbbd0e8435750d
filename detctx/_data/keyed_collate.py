"""A ``collate_fn`` whose random draws depend on the batch, not on where the stream stands.

A random collator (``DataCollatorForLanguageModeling``'s masking) draws from
the global streams of the process that collates: the main process, or a
loader worker. How far those streams have come when a batch is collated
depends on everything before it: the model's dropout, how many batches a
loader fetches ahead, how many were skipped on resume, which worker got the
batch. :class:`KeyedCollate` runs the collator in a world of its own instead:
every registered source (Python, NumPy, torch CPU, user sources) seeded from
``(seed, epoch, the batch's contents)``, and put back afterwards, so the
caller's streams do not move and a batch gets the same draws wherever and
whenever it is collated. Accelerators are left alone (collators run on the
CPU, and a loader worker must not touch a device).

The contents are read through the one canonical byte form
(:func:`detctx._state.canonical_bytes`, strict): sets by their sorted
elements, NumPy object arrays by their elements, conjugate and negative views
by their values, sparse tensors by their coalesced indices and values, nested
tensors by their components. What would key differently in another process
(a meta tensor, an object holding a set) raises ``TypeError`` before any RNG
is touched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Final

from detctx._basics import content_seed
from detctx._sources import RNGSource, registered_sources, seeder_of
from detctx._state import canonical_bytes, interrupts, restore_sources, transaction

__all__ = [
    "KEYED_STREAMS_VERSION",
    "KeyedCollate",
    "KeyedStreams",
    "content_digest",
    "keyed_streams",
]

Sources = list[tuple[str, RNGSource]]

KEYED_STREAMS_VERSION: Final = 2
"""How a keyed world seeds its streams from what it is keyed by, for checkpoints to name:
1, 32-bit seeds (``torch.manual_seed`` and NumPy's int seeding); 2, 64-bit seeds, every bit
reaching each built-in stream. A run resumed on another version draws other streams."""


class KeyedStreams:
    """A keyed world over ``sources``: ``with world as reseed:`` is one transaction in which
    ``reseed(seed)`` seeds every source of ``sources`` from the 64-bit ``seed``, every bit of
    it reaching each built-in stream (:func:`detctx._sources.seeder_of`).

    With ``put_back`` the sources are captured on entry and put back on exit,
    so the caller's streams do not move. Without it (a loader worker, whose
    streams are the loader's alone and are seeded again before every draw
    that matters) nothing is captured: a capture costs more than the seeding.
    One object serves any number of entries, nested ones included (an elastic
    loader enters its world once per batch: about 8 us in all).
    """

    __slots__ = ("_capture", "_open", "_preparers", "reseed")

    def __init__(self, sources: Sources, *, put_back: bool = True) -> None:
        seeders = [seeder_of(source) for _, source in sources]
        seeds = [seeder.seed for seeder in seeders]
        self._preparers = [seeder.prepare for seeder in seeders]

        def reseed_each(seed: int) -> None:
            for seed_one in seeds:
                seed_one(seed)

        # One source (streams=["torch"]): its own seed method, without a loop per call.
        self.reseed: Callable[[int], object] = seeds[0] if len(seeds) == 1 else reseed_each
        self._capture: Callable[[], transaction.State] = (
            (lambda: _Saved(sources)) if put_back else _Kept
        )
        self._open: list[transaction.State] = []

    def prepare(self, seeds: Sequence[int]) -> None:
        """Do ahead, for the 64-bit ``seeds`` together, what ``reseed`` of each needs (torch's
        states): about 1 us a seed, not 5 us one at a time. Touches no stream."""
        for prepare in self._preparers:
            prepare(seeds)

    def _opened(self, before: transaction.State) -> transaction.State:
        self._open.append(before)  # inside the transaction: no signal lands between
        return before

    def _undo(self, before: transaction.State) -> None:
        transaction.end(self._open.pop().restore_each)

    # A Ctrl-C at the start of either is held and handed on with the state whole: when the
    # world is in force, or after the caller's is back (an edge leads into a held section).
    @interrupts.edge
    def __enter__(self) -> Callable[[int], object]:
        # One transaction, as a block's: the lock keeps other threads' blocks out meanwhile.
        transaction.change(
            self._opened, self._capture, lasts=transaction.Lasts.UNTIL_END, undo=self._undo
        )
        return self.reseed

    @interrupts.edge
    def __exit__(self, *exc_info: object) -> None:
        transaction.end(self._open.pop().restore_each)


def keyed_streams(sources: Sources, *, put_back: bool = True) -> KeyedStreams:
    """A keyed world over ``sources`` (see :class:`KeyedStreams`), for one ``with``."""
    return KeyedStreams(sources, put_back=put_back)


class _Saved:
    """The states of a keyed world's sources, to put back (a ``Snapshot`` of the sources
    alone, without its names and fingerprints: captured for every batch a loader reads)."""

    __slots__ = ("_parts",)

    def __init__(self, sources: Sources) -> None:
        self._parts = [(source, source.capture()) for _, source in sources]

    def restore_each(self) -> None:
        """Put every source back, attempting each; the first failure is raised afterwards."""
        first_error = restore_sources(self._parts)
        if first_error is not None:
            raise first_error


class _Kept:
    """What a change that keeps nothing puts back: nothing."""

    def restore_each(self) -> None:
        return None


class KeyedCollate:
    """``collate(features)`` run in a world seeded from ``(seed, epoch, features)``.

    ``epoch`` (``None``: left out of the key) is set by whoever knows it
    before the loader's workers are started.
    """

    def __init__(self, collate: Callable[[Any], Any], seed: int) -> None:
        self.collate = collate
        self.seed = seed
        self.epoch: int | None = None

    def __call__(self, features: Any) -> Any:
        seed = content_seed(self.seed, self.epoch, content_digest(features))
        with keyed_streams(list(registered_sources())) as reseed:
            reseed(seed)
            return self.collate(features)

    def __repr__(self) -> str:
        return f"KeyedCollate({self.collate!r}, seed={self.seed}, epoch={self.epoch})"


def content_digest(value: Any) -> bytes:
    """16 bytes that depend only on ``value``'s contents (tensors by dtype, shape and values),
    the same in every process; ``TypeError`` for what cannot be read so."""
    return hashlib.blake2b(canonical_bytes(value, strict=True), digest_size=16).digest()
