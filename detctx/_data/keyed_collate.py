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
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from detctx._sources import registered_sources
from detctx._state import Snapshot, transaction

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
        words = [self.seed, -1 if self.epoch is None else self.epoch]
        digest = content_digest(features)
        words += [int.from_bytes(digest[i : i + 4], "little") for i in range(0, len(digest), 4)]
        sequence = np.random.SeedSequence([word & 0xFFFFFFFF for word in words])
        seed = int(sequence.generate_state(1)[0])
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
    """16 bytes that depend only on ``value``'s contents (tensors by dtype, shape and bits)."""
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, value)
    return digest.digest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(b"T%s%s" % (str(tensor.dtype).encode(), str(tuple(tensor.shape)).encode()))
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(b"A%s%s" % (str(value.dtype).encode(), str(value.shape).encode()))
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        digest.update(b"{%d" % len(value))
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(b"(%d" % len(value))
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        digest.update(repr(value).encode())
    else:
        # Anything else by its pickled bytes (a repr may hold a memory address).
        digest.update(b"P" + pickle.dumps(value, protocol=4))
