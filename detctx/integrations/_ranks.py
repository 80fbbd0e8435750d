"""Every rank's state in one checkpoint entry: gathered when saving, this rank's picked on resume.

Frameworks write a checkpoint from rank 0 alone (Lightning's
``strategy.save_checkpoint``), so whatever a callback returns on the other
ranks is lost unless it is gathered first. A rank's RNG streams and its
loader's position (sampler offset, workers' streams) are its own, and a
run resumed with rank 0's state on every rank continues neither exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from detctx._basics import CheckpointError

__all__ = ["gather_ranks", "pick_rank", "rank_and_world"]


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (``0, 1`` without a process group)."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank(), distributed.get_world_size()
    return 0, 1


def gather_ranks(value: Any) -> list[Any]:
    """``value`` of every rank, by rank; a collective, so every rank must call it."""
    _, world = rank_and_world()
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def pick_rank(saved: Any, where: str) -> Any:
    """This rank's entry of ``saved`` (a list by rank), checked against the world size.

    Raises :class:`~detctx.CheckpointError`, naming both world sizes, when
    ``saved`` was written by another number of processes: each rank's loader
    position and streams belong to its shard, which another world size splits
    differently.
    """
    rank, world = rank_and_world()
    if not isinstance(saved, Sequence) or isinstance(saved, (str, bytes)) or not saved:
        raise CheckpointError(f"{where} holds no per-rank states (a list by rank)")
    if len(saved) != world:
        raise CheckpointError(
            f"{where} was saved by {len(saved)} process(es) (world size {len(saved)}) and is "
            f"resumed by {world} (this is rank {rank}): each rank's RNG streams and loader "
            "position belong to its shard, which another world size splits differently. "
            f"Resume with {len(saved)} process(es) (devices x nodes), or start a new run "
            "from the checkpoint's weights alone"
        )
    return saved[rank]
