"""Reads and writes of ``os.environ`` for the world swaps, without its per-call encoding.

A decorated generator's or coroutine's world swap reads every switch's
variable twice a step, and writes each twice a step when the two worlds
differ. ``os.environ`` encodes the name (and the value) through two Python
calls every time, and ``os.environ.pop`` reads a value before deleting it.
These functions use the same mapping and the same ``putenv`` / ``unsetenv``
calls, with each name encoded once. Where ``os.environ`` is built differently
(not POSIX), they are ``os.environ``'s own operations.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["getenv", "setenv"]

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
