"""The envelope of everything detctx writes to a checkpoint, and the one rule for reading it.

Each dict detctx saves (an RNG state dict, a resume state, a loader's state,
the Lightning callback's state) carries ``"format"``, naming what it is, and
``"version"``, the layout of the rest. The version policy is one for all: a
reader takes every version from 1 up to its own and refuses a newer one,
asking for a newer detctx, before anything in the process changes. Anything
else (no mapping, another format, a version that is not a positive int) is
refused as not this kind of state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from detctx._basics.errors import CheckpointError

__all__ = ["open_envelope", "plain_digest", "same_plain"]


def open_envelope(
    value: object, kind: str, version: int, *, what: str, refusal: str, hint: str = ""
) -> Mapping[str, Any]:
    """``value`` as a mapping once its envelope is ``kind`` at a version this detctx reads.

    ``what`` names the state in messages (``"the resume state"``); ``refusal``
    says what a value of another kind is not, ``hint`` what to pass instead.
    Raises :class:`~detctx.CheckpointError`.
    """
    # Untrusted: a crafted "format" (an array, a tensor) must not be compared elementwise.
    if not isinstance(value, Mapping) or type(value.get("format")) is not str or (
        value["format"] != kind
    ):
        advice = f"; {hint}" if hint else ""
        raise CheckpointError(f"{refusal} (no 'format': {kind!r} entry){advice}")
    found = value.get("version")
    if not isinstance(found, int) or isinstance(found, bool) or found < 1:
        raise CheckpointError(f"{what} has an invalid format version {found!r}")
    if found > version:
        raise CheckpointError(
            f"{what} was written by a newer detctx (format version {found}); this detctx "
            f"reads version {version} and older: upgrade detctx to read it"
        )
    return value


def plain_digest(value: Any) -> str:
    """A digest of plain data (dicts, lists, tensors, ints, floats, strings, bools, ``None``):
    equal for equal data, whatever the key order; every part length-prefixed, so no two
    different values run together into the same bytes."""
    import torch  # imported where used: nothing in _basics imports torch at import time

    sink = hashlib.blake2b(digest_size=16)
    _feed(sink, value, torch)
    return sink.hexdigest()


def _feed(sink: Any, value: Any, torch: Any) -> None:
    if isinstance(value, Mapping):
        sink.update(b"d%d;" % len(value))
        for key in sorted(value, key=repr):
            _feed(sink, key, torch)
            _feed(sink, value[key], torch)
    elif isinstance(value, (list, tuple)):
        sink.update(b"l%d;" % len(value))
        for item in value:
            _feed(sink, item, torch)
    elif isinstance(value, torch.Tensor):
        # Bytes of a copy: NumPy never sees the tensor's own memory (torch then keeps that
        # storage from being resized, as FSDP2 does to its parameters).
        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        data = raw.clone().numpy().tobytes()
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
