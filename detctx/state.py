"""Snapshots of every managed RNG, as values."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from detctx import checkpoint
from detctx.accelerators import Uninitialised, active_accelerators
from detctx.sources import RNGSource, registered_sources, registry_version

__all__ = ["RNGState", "active_sources", "capture", "fingerprint", "restore"]


_active_cache: tuple[int, object, list[tuple[str, RNGSource]]] | None = None


def active_sources() -> list[tuple[str, RNGSource]]:
    """Every source a block manages now: built-ins, available accelerators, user sources.

    The list is cached until a source is (un)registered or the accelerators
    change; callers must not modify it.
    """
    global _active_cache
    accelerators = active_accelerators()
    version = registry_version()
    if (
        _active_cache is not None
        and _active_cache[0] == version
        and _active_cache[1] is accelerators
    ):
        return _active_cache[2]
    found: list[tuple[str, RNGSource]] = []
    user: list[tuple[str, RNGSource]] = []
    for name, source in registered_sources():
        (found if name in ("python", "numpy", "torch") else user).append((name, source))
    found.extend((acc.device_type, acc) for acc in accelerators)
    found.extend(user)
    _active_cache = (version, accelerators, found)
    return found


class RNGState(Mapping[str, Any]):
    """The states of a set of RNG sources at one moment, keyed by source name.

    Made by :func:`capture`. ``restore()`` puts every captured source back;
    sources registered after the capture are left alone.
    """

    __slots__ = ("_sources", "_states")

    def __init__(self, sources: list[tuple[str, RNGSource]], states: list[Any]) -> None:
        self._sources = sources
        self._states = states

    @classmethod
    def capture(cls, sources: list[tuple[str, RNGSource]] | None = None) -> RNGState:
        if sources is None:
            sources = active_sources()
        return cls(sources, [source.capture() for _, source in sources])

    def restore(self) -> None:
        """Put every captured source back into its captured state.

        Every source is attempted even if one fails; the first failure is
        raised afterwards.
        """
        first_error: BaseException | None = None
        for (_, source), state in zip(self._sources, self._states):
            try:
                source.restore(state)
            except Exception as exc:
                if first_error is None:
                    first_error = exc
        if first_error is not None:
            raise first_error

    def state_dict(self) -> dict[str, Any]:
        """The captured states as plain data for a checkpoint.

        Tensors, ints, floats, strings, ``None``, lists and dicts only, so
        ``torch.save`` then ``torch.load(..., weights_only=True)`` round-trips
        it. A device type that was not initialised is stored as the seed
        pending for it. See :mod:`detctx.checkpoint` for each source's layout.
        """
        return checkpoint.encode(self._sources, self._states)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any], *, strict: bool = True) -> RNGState:
        """The state a :meth:`state_dict` describes, bound to this process's sources.

        Restores nothing by itself; call :meth:`restore`. Raises
        :class:`~detctx.errors.CheckpointError` (before any RNG is touched)
        for a dict of another format version, a source in the dict that is
        not registered here, a state that does not fit its source and, with
        ``strict`` (the default), a source managed here that the dict lacks.
        """
        sources, states = checkpoint.decode(state_dict, active_sources(), strict=strict)
        return cls(sources, states)

    def fingerprint(self) -> str:
        """A 16-hex-digit digest of the captured states (equal digests: equal states)."""
        digest = hashlib.blake2b(digest_size=8)
        for name, state in self.items():
            digest.update(name.encode())
            _feed(digest, state)
        return digest.hexdigest()

    def __getitem__(self, name: str) -> Any:
        for (source_name, _), state in zip(self._sources, self._states):
            if source_name == name:
                return state
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __repr__(self) -> str:
        return f"RNGState(sources={list(self)}, fingerprint={self.fingerprint()!r})"


def capture() -> RNGState:
    """Snapshot every managed RNG (Python, NumPy, torch CPU, each available
    accelerator, registered sources) without changing any of them, and
    without initialising a device the program has not used."""
    return RNGState.capture()


def restore(state: RNGState | Mapping[str, Any], *, strict: bool = True) -> None:
    """Put every RNG back into ``state``: an :class:`RNGState` or its ``state_dict()``.

    A state dict is checked in full first (see :meth:`RNGState.from_state_dict`),
    so a bad one raises :class:`~detctx.errors.CheckpointError` with nothing changed.
    """
    if not isinstance(state, RNGState):
        state = RNGState.from_state_dict(state, strict=strict)
    state.restore()


def fingerprint() -> str:
    """A short hex digest of all current RNG states: equal digests mean equal states."""
    return RNGState.capture().fingerprint()


def _pack_ints(values: tuple[Any, ...] | list[Any]) -> bytes | None:
    """Non-negative 64-bit ints packed in one call (Python's random state is 625 of them)."""
    if not values or type(values[0]) is not int:
        return None
    try:
        return b"I%d" % len(values) + array("Q", values).tobytes()
    except (TypeError, OverflowError):
        return None


def _feed(digest: Any, value: Any) -> None:
    """Hash ``value`` canonically: the same value always gives the same bytes."""
    if isinstance(value, torch.Tensor):
        digest.update(b"T" + str(value.dtype).encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(b"A" + str(value.dtype).encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (tuple, list)) and (packed := _pack_ints(value)) is not None:
        digest.update(packed)
    elif isinstance(value, (tuple, list)):
        digest.update(b"(%d" % len(value))
        for item in value:
            _feed(digest, item)
    elif isinstance(value, dict):
        digest.update(b"{%d" % len(value))
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, value[key])
    elif isinstance(value, Uninitialised):
        # Not readable without waking the device; what is pending is what counts.
        digest.update(b"U%d" % value.seed_before)
    else:
        digest.update(repr(value).encode())
