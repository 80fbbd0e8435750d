"""Environment variables: the fast reader, and the variables frameworks set that a block puts back.

Frameworks export determinism variables of their own when they are asked to
seed: ``transformers.enable_full_determinism`` sets ``CUDA_LAUNCH_BLOCKING``
and ``ASCEND_LAUNCH_BLOCKING`` (besides variables the switches own), and
Lightning's ``seed_everything`` sets ``PL_GLOBAL_SEED`` and
``PL_SEED_WORKERS``. A block does not set these, but whatever a framework
sets inside the block must not outlive it, so every snapshot with switches
also holds :data:`WATCHED` and puts each of its variables back (or unsets it)
on exit. They are not switches: nothing is applied on entry and there is no
keyword to turn them off.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Final

__all__ = ["WATCHED", "WatchedVariables", "getenv"]

# os.environ.get re-encodes the name on every call; a swap of a decorated generator
# reads every variable twice per step. Read the mapping behind os.environ directly
# (the same data, already encoded) where this Python has it.
_environ_data: Any = getattr(os.environ, "_data", None)
_fast: Final = _environ_data is not None and hasattr(os.environ, "encodekey")
_encoded: dict[str, Any] = {}


def _key(name: str) -> Any:
    key = _encoded.get(name)
    if key is None:
        key = _encoded[name] = os.environ.encodekey(name)
    return key


def getenv(name: str) -> str | None:
    """``os.environ.get(name)``, without re-encoding ``name`` on every call."""
    if not _fast:
        return os.environ.get(name)
    raw = _environ_data.get(_key(name))
    return None if raw is None else str(os.environ.decodevalue(raw))


class WatchedVariables:
    """Environment variables a block captures and restores but never sets.

    ``capture()`` is one tuple of the variables' raw values (``None`` when
    unset); ``restore(saved)`` writes back, or unsets, only those that differ
    now. The part is named ``"watched environment"`` in a snapshot.
    """

    name: Final = "watched environment"

    def __init__(self, variables: Iterable[str]) -> None:
        self.variables: tuple[str, ...] = tuple(variables)
        self._keys = tuple(_key(name) for name in self.variables) if _fast else ()

    def capture(self) -> tuple[Any, ...]:
        if _fast:
            return tuple(map(_environ_data.get, self._keys))
        return tuple([os.environ.get(name) for name in self.variables])

    def restore(self, saved: tuple[Any, ...]) -> None:
        now = self.capture()
        if now == saved:
            return
        for name, before, current in zip(self.variables, saved, now):
            if before == current:
                continue
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = os.environ.decodevalue(before) if _fast else before


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
