"""Environment variables: fast reads and writes, and the variables frameworks set.

A decorated generator's or coroutine's world swap reads every switch's
variable twice a step, and writes each twice a step when the two worlds
differ. ``os.environ`` encodes the name (and the value) through two Python
calls every time, and ``os.environ.pop`` reads a value before deleting it.
:func:`getenv` and :func:`setenv` use the same mapping and the same
``putenv`` / ``unsetenv`` calls, with each name encoded once. Where
``os.environ`` is built differently (not POSIX), they are ``os.environ``'s
own operations.

Frameworks also export determinism variables of their own when they are
asked to seed: ``transformers.enable_full_determinism`` sets
``CUDA_LAUNCH_BLOCKING`` and ``ASCEND_LAUNCH_BLOCKING`` (besides variables
the switches own), and Lightning's ``seed_everything`` sets
``PL_GLOBAL_SEED`` and ``PL_SEED_WORKERS``. A block does not set these, but
whatever a framework sets inside the block must not outlive it, so every
snapshot with switches also holds :data:`WATCHED` and puts each of its
variables back (or unsets it) on exit. They are not switches: nothing is
applied on entry and there is no keyword to turn them off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, Final

__all__ = ["WATCHED", "WatchedVariables", "getenv", "setenv"]

_data: Any = getattr(os.environ, "_data", None)
# CPython's POSIX os.environ: bytes keys and values, encoded with the file system
# encoding and surrogateescape (os._createenviron).
_FAST = _data is not None and os.name == "posix" and hasattr(os, "unsetenv")
_ENCODING = sys.getfilesystemencoding()
_keys: dict[str, bytes] = {}


def _key(name: str) -> bytes:
    key = _keys.get(name)
    if key is None:
        key = _keys[name] = name.encode(_ENCODING, "surrogateescape")
    return key


def getenv(name: str) -> str | None:
    """``os.environ.get(name)``."""
    if not _FAST:
        return os.environ.get(name)
    raw = _data.get(_key(name))
    return None if raw is None else str(raw.decode(_ENCODING, "surrogateescape"))


def setenv(name: str, value: str | None) -> None:
    """``os.environ[name] = value``, or ``name`` unset for ``None``."""
    if not _FAST:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        return
    key = _key(name)
    if value is None:
        if key in _data:
            os.unsetenv(key)
            del _data[key]
    else:
        encoded = value.encode(_ENCODING, "surrogateescape")
        os.putenv(key, encoded)
        _data[key] = encoded


def _decode(raw: bytes) -> str:
    return raw.decode(_ENCODING, "surrogateescape")


class WatchedVariables:
    """Environment variables a block captures and restores but never sets.

    ``capture()`` is one tuple of the variables' raw values (``None`` when
    unset); ``restore(saved)`` writes back, or unsets, only those that differ
    now. The part is named ``"watched environment"`` in a snapshot.
    """

    name: Final = "watched environment"

    def __init__(self, variables: Iterable[str]) -> None:
        self.variables: tuple[str, ...] = tuple(variables)
        self._keys = tuple(_key(name) for name in self.variables) if _FAST else ()

    def capture(self) -> tuple[Any, ...]:
        if _FAST:
            return tuple(map(_data.get, self._keys))
        return tuple([os.environ.get(name) for name in self.variables])

    def restore(self, saved: tuple[Any, ...]) -> None:
        now = self.capture()
        if now == saved:
            return
        for name, before, current in zip(self.variables, saved, now):
            if before != current:
                setenv(name, _decode(before) if _FAST and before is not None else before)


WATCHED: Final = WatchedVariables(
    (
        # transformers.enable_full_determinism (trainer_utils.py)
        "CUDA_LAUNCH_BLOCKING",
        "ASCEND_LAUNCH_BLOCKING",
        # lightning.fabric.utilities.seed.seed_everything
        "PL_GLOBAL_SEED",
        "PL_SEED_WORKERS",
    )
)
"""The variables frameworks set when seeding, that no switch owns."""
