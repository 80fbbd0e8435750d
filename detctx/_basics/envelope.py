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

from collections.abc import Mapping
from typing import Any

from detctx._basics.errors import CheckpointError

__all__ = ["open_envelope"]


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
