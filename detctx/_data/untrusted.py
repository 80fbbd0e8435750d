"""Values read from a checkpoint, checked: untrusted data (a tensor where an int was saved, a
bool for an int, a dict of other keys) gives a :class:`~detctx.CheckpointError` that names the
entry and what it should be, never an error from deeper down or an ambiguous truth value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from detctx._basics import CheckpointError

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


def digest(value: Any) -> str:
    """A digest of plain data (dicts, lists, tensors, ints, floats, strings, bools, ``None``):
    equal for equal data, whatever the key order; every part length-prefixed, so no two
    different values run together into the same bytes."""
    sink = hashlib.blake2b(digest_size=16)
    _feed(sink, value)
    return sink.hexdigest()


def _feed(sink: Any, value: Any) -> None:
    if isinstance(value, Mapping):
        sink.update(b"d%d;" % len(value))
        for key in sorted(value, key=repr):
            _feed(sink, key)
            _feed(sink, value[key])
    elif isinstance(value, (list, tuple)):
        sink.update(b"l%d;" % len(value))
        for item in value:
            _feed(sink, item)
    elif isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        shape = ",".join(map(str, value.shape))
        sink.update(b"t%s;%s;%d;" % (str(value.dtype).encode(), shape.encode(), len(data)))
        sink.update(data)
    elif value is None or isinstance(value, (bool, int, float, str)):
        text = f"{type(value).__name__}:{value!r}".encode()
        sink.update(b"v%d;" % len(text) + text)
    else:
        raise CheckpointError(
            f"a checkpoint state holds a {type(value).__name__}, not plain data (tensors, "
            "numbers, strings, None, lists and dicts): resume from a checkpoint detctx saved"
        )


def same_plain(value: Any, expected: Any) -> bool:
    """``value`` (from a checkpoint: maybe a tensor, a bool for an int) is ``expected``
    (plain data: dicts, ints, bools, strings, ``None``), type for type."""
    if type(value) is not type(expected):
        return False
    if isinstance(expected, Mapping):
        return set(value) == set(expected) and all(
            same_plain(value[key], expected[key]) for key in expected
        )
    return bool(value == expected)


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
