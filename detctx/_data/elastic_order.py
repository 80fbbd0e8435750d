"""The order of an elastic loader's epoch and each rank's part of it, from one position.

The order is a permutation drawn from ``(seed, epoch)`` alone, by NumPy's
legacy ``RandomState``, whose streams NumPy keeps frozen across releases
(``torch.randperm``'s algorithm has changed between torch releases). A
step takes the next ``world_size * batch_size`` positions of the order (a
global batch); rank ``r`` takes the contiguous part ``[r * batch_size, (r +
1) * batch_size)`` of it, so the ranks' batches of one step, in rank order,
are the order itself, and the position is one number: the samples consumed
over every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import numpy as np
import torch

from detctx._basics import derive_seed, indexed_seed, validate_seed
from detctx._data.elastic_streams import KeyBatch, Keys

__all__ = ["ElasticBatches", "Position"]

_ORDER_KEY: Final = 0x5A4D_0000
_SEEDED_AT_ONCE: Final = 1024


class Position:
    """Where an elastic loader stands: ``epoch`` and the samples consumed globally in it."""

    def __init__(self) -> None:
        self.epoch = 0
        self.consumed = 0
        self.generation = 0  # bumped when the position is set from outside an iterator

    def move_to(self, epoch: int, consumed: int) -> None:
        self.epoch, self.consumed = epoch, consumed
        self.generation += 1


class ElasticBatches(torch.utils.data.Sampler[KeyBatch]):
    """The batch sampler: this rank's part of each global batch, from the loader's position.

    Each batch is a :class:`~detctx._data.elastic_streams.KeyBatch`: the positions,
    dataset indices and seeds of its samples, and its collate seed. ``set_epoch(e)``
    (called by Lightning and the Hugging Face Trainer at each epoch) starts
    epoch ``e`` from its beginning, unless ``e`` is the current epoch, whose
    position is kept (a resumed epoch continues).
    """

    def __init__(
        self,
        length: int,
        *,
        seed: int,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        rank: int,
        world_size: int,
        position: Position,
        keys: Keys,
    ) -> None:
        self.length = length
        self.seed = seed
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.position = position
        self.sample_keys = keys
        self._order: tuple[int, np.ndarray[Any, Any]] | None = None
        # Epoch e's order is drawn with item e of this family of seeds (SeedSequence once,
        # SplitMix64 for each epoch).
        self._orders = derive_seed(seed, _ORDER_KEY)
        self._shuffler: np.random.RandomState | None = None

    @property
    def global_batch(self) -> int:
        """Samples one step takes from the order, over every rank."""
        return self.batch_size * self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (the current epoch keeps its position)."""
        epoch = validate_seed(epoch, "epoch")
        if epoch != self.position.epoch:
            self.position.move_to(epoch, 0)

    def order(self, epoch: int) -> np.ndarray[Any, Any]:
        """The dataset indices in ``epoch``'s order, from ``(seed, epoch)`` alone."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                # One RandomState reseeded per epoch: making one costs about 300 us
                # (NumPy 2.4), seeding it 1 us, and the streams are the same.
                if self._shuffler is None:
                    self._shuffler = np.random.RandomState()
                # The high half of the epoch's 64-bit seed: what the order has always been
                # drawn from (RandomState takes 32 bits), so saved positions keep their order.
                self._shuffler.seed(indexed_seed(self._orders, epoch) >> 32)
                self._order = (epoch, self._shuffler.permutation(self.length))
            else:
                self._order = (epoch, np.arange(self.length))
        return self._order[1]

    def end(self, start: int) -> int:
        """Where an epoch resumed at ``start`` ends (a partial global batch is dropped with
        ``drop_last``)."""
        if not self.drop_last:
            return self.length
        return start + (self.length - start) // self.global_batch * self.global_batch

    def __iter__(self) -> Iterator[KeyBatch]:
        # The position is read now, not at the first batch: a DataLoader makes this
        # iterator before it fetches anything.
        return self.keys(self.position.epoch, self.position.consumed)

    def keys(self, epoch: int, start: int) -> Iterator[KeyBatch]:
        """This rank's keys for each step of ``epoch`` from ``start``, with their seeds.

        The seeds are derived for many steps at a time (one NumPy call for up to
        ``_SEEDED_AT_ONCE`` samples of this rank): a call per batch cost about a
        third of what seeding its samples does.
        """
        order = self.order(epoch)
        end = self.end(start)
        size, step, mine_from = self.batch_size, self.global_batch, self.rank * self.batch_size
        firsts = range(start, end, step)
        steps = max(1, _SEEDED_AT_ONCE // size)
        for at in range(0, len(firsts), steps):
            # The positions [mine, stop) this rank takes of each step of the chunk.
            spans = []
            for first in firsts[at : at + steps]:
                mine = first + mine_from
                spans.append((mine, max(mine, min(mine + size, first + step, end))))
            if self.world_size == 1:  # one rank: its spans follow each other
                chosen = order[spans[0][0] : spans[-1][1]]
            else:
                chosen = np.concatenate([order[mine:stop] for mine, stop in spans])
            firsts_mine = [mine for mine, _ in spans]
            seeds, collate_seeds = self.sample_keys.seeds(epoch, chosen, firsts_mine)
            indices: list[int] = chosen.tolist()
            offset = 0
            for (mine, stop), collate_seed in zip(spans, collate_seeds):
                taken = offset + stop - mine
                yield KeyBatch(
                    epoch, mine, indices[offset:taken], seeds[offset:taken], collate_seed
                )
                offset = taken

    def __len__(self) -> int:
        """Batches in a whole epoch on this rank."""
        whole, rest = divmod(self.length, self.global_batch)
        return whole + (1 if rest and not self.drop_last else 0)
