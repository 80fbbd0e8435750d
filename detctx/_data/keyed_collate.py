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
from collections.abc import Callable
from typing import Any

from detctx._basics import content_seed
from detctx._sources import registered_sources
from detctx._state import Snapshot, canonical_bytes, transaction

__all__ = ["KeyedCollate", "content_digest"]


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
        sources = list(registered_sources())

        def seeded(before: Snapshot) -> Snapshot:
            for _, source in sources:
                source.seed(seed)
            return before

        # One transaction, as a block's: seeding that fails half-way is rolled back, and
        # a Ctrl-C lands before the collator's world is in force or after it is gone.
        before = transaction.change(
            seeded,
            lambda: Snapshot.capture(sources),
            lasts=transaction.Lasts.UNTIL_END,
            undo=lambda saved: transaction.end(saved.restore_each),
        )
        try:
            return self.collate(features)
        finally:
            transaction.end(before.restore_each)

    def __repr__(self) -> str:
        return f"KeyedCollate({self.collate!r}, seed={self.seed}, epoch={self.epoch})"


def content_digest(value: Any) -> bytes:
    """16 bytes that depend only on ``value``'s contents (tensors by dtype, shape and values),
    the same in every process; ``TypeError`` for what cannot be read so."""
    return hashlib.blake2b(canonical_bytes(value, strict=True), digest_size=16).digest()
