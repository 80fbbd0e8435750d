"""Values read from a checkpoint, checked: untrusted data (a tensor where an int was saved, a
bool for an int, a dict of other keys) gives a :class:`~detctx.CheckpointError` that names the
entry and what it should be, never an error from deeper down or an ambiguous truth value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from detctx._basics import CheckpointError, same_plain
from detctx._basics import plain_digest as digest

__all__ = [
    "count",
    "digest",
    "entries",
    "generator_state",
    "keys_of",
    "nothing",
    "same_plain",
    "shown",
]


def generator_state(value: Any, where: str) -> torch.Tensor:
    """``value`` if a CPU ``torch.Generator`` accepts it as its state, else raise."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise CheckpointError(
            f"{where} is {shown(value)}; a CPU generator state is a 1-D uint8 tensor"
        )
    try:
        torch.Generator().set_state(value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{where} is not a valid CPU generator state ({exc})") from None
    return value


def entries(
    value: Any, where: str, keys: frozenset[str], optional: frozenset[str] = frozenset()
) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not keys <= set(value) <= keys | optional:
        raise CheckpointError(
            f"{where} holds {keys_of(value)}; this loader saves {sorted(keys)} there: was the "
            "state saved by a loader built differently, or edited?"
        )
    return value


def count(value: Any, where: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        span = f"{low}" if low == high else f"from {low} to {high}"
        raise CheckpointError(
            f"{where} is {shown(value)}; for this loader and position it is the int {span}"
        )
    return value


def nothing(entries: Mapping[str, Any], where: str, keys: Iterable[str]) -> None:
    for key in keys:
        if entries[key] is not None:
            raise CheckpointError(
                f"{where}.{key} is {shown(entries[key])}; this loader saves None there"
            )


def keys_of(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"keys {sorted(map(str, value))}"
    return f"a {type(value).__name__}"


def shown(value: Any) -> str:
    """``value`` read from a checkpoint, for a message: short, and a tensor by its kind."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else text
