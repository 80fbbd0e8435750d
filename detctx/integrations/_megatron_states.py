"""Megatron's tracker states: read, made and checked the way its ``tracker.add`` makes them.

Used by :mod:`detctx.integrations.megatron`; the checks run before anything
changes, so a refused checkpoint leaves the tracker and the device as they were.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from detctx._sources import InvalidField
from detctx._state import device_state_seed

__all__ = [
    "check_seeds",
    "device_in_use",
    "read_state",
    "seeded_state",
    "seeds_kept",
    "try_on_device",
]


def check_seeds(states: Mapping[str, torch.Tensor], seeds: list[int]) -> None:
    """The tracker's record of seeds against its states: Megatron's ``tracker.add`` seeds
    each state with a seed it records and refuses a recorded seed, so a record without a
    state's seed lets a later ``add`` make a second state with that seed's stream."""
    repeated = sorted(seed for seed, count in Counter(seeds).items() if count > 1)
    if repeated:
        raise InvalidField("seeds", f"hold {repeated} more than once; the tracker's are distinct")
    recorded = set(seeds)
    unrecorded = {
        name: seed
        for name, value in states.items()
        if (seed := device_state_seed(value)) is not None and seed not in recorded
    }
    if unrecorded:
        raise InvalidField("seeds", f"lack the seed(s) the states were made with: {unrecorded}")


def seeds_kept(record: Iterable[int], replaced: Iterable[Any]) -> set[int]:
    """The tracker's record of seeds once the ``replaced`` states are seeded anew: without
    their old seeds (where their layout keeps them), so that the record stays one seed per
    state however often blocks seed the tracker."""
    dropped = {device_state_seed(read_state(value)) for value in replaced}
    return {int(seed) for seed in record} - dropped


def read_state(value: Any) -> torch.Tensor:
    """A copy of one tracker state (a graph-safe tracker holds generators, not tensors)."""
    if isinstance(value, torch.Generator):
        return value.get_state()
    clone: torch.Tensor = value.clone()
    return clone


def seeded_state(seed: int) -> torch.Tensor:
    """A state seeded with ``seed``, made the way Megatron's ``tracker.add`` makes it."""
    # Through torch.cuda, as Megatron: transfer_to_npu points these calls at torch.npu.
    cuda = torch.cuda
    before = cuda.get_rng_state()
    try:
        cuda.manual_seed(seed)
        return cuda.get_rng_state()
    finally:
        cuda.set_rng_state(before)


def device_in_use() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def try_on_device(name: str, value: torch.Tensor) -> None:
    cuda = torch.cuda
    before = cuda.get_rng_state()
    try:
        try:
            cuda.set_rng_state(value)
            kept = cuda.get_rng_state()
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidField(f"states[{name!r}]", f"refused by the device ({exc})") from exc
    finally:
        cuda.set_rng_state(before)
    if not torch.equal(kept, value):
        raise InvalidField(f"states[{name!r}]", "holds values the device does not keep as given")
