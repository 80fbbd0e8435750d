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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from detctx._basics import content_seed
from detctx._sources import RNGSource, registered_sources
from detctx._state import Snapshot, canonical_bytes, transaction

__all__ = ["KeyedCollate", "content_digest", "keyed_streams"]

Sources = list[tuple[str, RNGSource]]


@contextmanager
def keyed_streams(sources: Sources, *, put_back: bool = True) -> Iterator[Callable[[int], None]]:
    """One transaction in which ``reseed(seed)`` seeds every source of ``sources``.

    With ``put_back`` the sources are captured on entry and put back on exit,
    so the caller's streams do not move. Without it (a loader worker, whose
    streams are the loader's alone and are seeded again before every draw
    that matters) nothing is captured: a capture costs more than the seeding.
    """

    seeders = [source.seed for _, source in sources]

    def reseed(seed: int) -> None:
        for seeder in seeders:
            seeder(seed)

    capture: Callable[[], Any] = (lambda: Snapshot.capture(sources)) if put_back else _Kept
    # One transaction, as a block's: a Ctrl-C lands before the keyed world is in force or
    # after the caller's is back, and the lock keeps other threads' blocks out meanwhile.
    before = transaction.change(
        lambda captured: captured,
        capture,
        lasts=transaction.Lasts.UNTIL_END,
        undo=lambda saved: transaction.end(saved.restore_each),
    )
    try:
        # One source (streams=["torch"]): its own seed method, without a loop per call.
        yield seeders[0] if len(seeders) == 1 else reseed
    finally:
        transaction.end(before.restore_each)


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
