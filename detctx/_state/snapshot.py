"""Snapshots: every managed RNG state, and optionally every switch, as one value.

One type serves every use: a block's entry snapshot and a decorated
generator's private world hold RNG states and switch values; :func:`capture`
holds RNG states only. Parts are keyed by name (source names, switch names).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import detctx._state.state_dict as state_dict
import detctx._state.transaction as transaction
import detctx._state.values as state_values
from detctx._basics import process_cache
from detctx._environment import WATCHED
from detctx._sources import RNGSource, active_accelerators, registered_sources, registry_version
from detctx._switches import SWITCHES

__all__ = ["Snapshot", "active_sources", "capture", "fingerprint", "restore", "restore_sources"]


class _Part(Protocol):
    """A switch, or the watched environment variables: put back by ``restore``."""

    def restore(self, saved: Any) -> None: ...


_active_cache: tuple[int, object, list[tuple[str, RNGSource]]] | None = None


@process_cache
def _forget_active() -> None:
    global _active_cache
    _active_cache = None


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


class Snapshot(Mapping[str, Any]):
    """The states of a set of RNG sources, and maybe of the switches, at one moment.

    As a mapping it is ``{source name: captured state}``; :attr:`switches`
    maps switch names to their captured values, and ``"watched environment"``
    to the variables frameworks set (empty for :func:`capture`, which leaves
    flags and environment variables out). ``restore()`` puts
    every captured part back; sources registered after the capture are left
    alone. ``detctx.RNGState``, deprecated, is this class.
    """

    __slots__ = ("_rng", "_sources", "_switches")

    def __init__(
        self,
        rng: dict[str, tuple[RNGSource, Any]],
        switches: dict[str, tuple[_Part, Any]] | None = None,
        *,
        sources: list[tuple[str, RNGSource]] | None = None,
    ) -> None:
        self._rng = rng
        self._switches = {} if switches is None else switches
        self._sources = sources

    @classmethod
    def capture(
        cls, sources: list[tuple[str, RNGSource]] | None = None, *, switches: bool = False
    ) -> Snapshot:
        """Capture ``sources`` (default: every active source) and, with ``switches``, every
        switch and the watched environment variables (``WATCHED``).
        Nothing is changed and no device the program has not used is woken."""
        if sources is None:
            sources = active_sources()
        rng = {name: (source, source.capture()) for name, source in sources}
        if not switches:
            return cls(rng, sources=sources)
        parts: dict[str, tuple[_Part, Any]] = {
            switch.name: (switch, switch.capture()) for switch in SWITCHES
        }
        parts[WATCHED.name] = (WATCHED, WATCHED.capture())
        return cls(rng, parts, sources=sources)

    @classmethod
    def capture_everything(cls) -> Snapshot:
        """Every active source, every switch and the watched variables: what a block saves."""
        return cls.capture(active_sources(), switches=True)

    @property
    def sources(self) -> list[tuple[str, RNGSource]]:
        """The ``(name, source)`` pairs captured, in capture order."""
        if self._sources is None:
            self._sources = [(name, source) for name, (source, _) in self._rng.items()]
        return self._sources

    @property
    def switches(self) -> Mapping[str, Any]:
        """The captured switch values, by switch name."""
        return {name: value for name, (_, value) in self._switches.items()}

    def switch_value(self, name: str) -> Any:
        """The captured value of the switch ``name`` (``KeyError`` if not captured)."""
        return self._switches[name][1]

    def restore(self) -> None:
        """Put every captured part back, atomically.

        Switches go back in reverse order, then RNGs. If any part fails (a
        ``KeyboardInterrupt`` included), every part is put back to what it
        was before the call, then the failure is raised; a Ctrl-C during the
        call is raised after it, with the state whole. Sources registered
        after the capture are left alone.
        """
        transaction.change(
            lambda before: self.restore_each(),
            lambda: Snapshot.capture(self.sources, switches=bool(self._switches)),
            lasts=transaction.Lasts.DONE,
        )

    def restore_each(self, unchanged: Snapshot | None = None, *, layered: bool = False) -> None:
        """Put every captured part back, attempting each even if one fails; the first
        failure is raised afterwards. Not atomic: for a caller inside a transaction.

        ``unchanged``: a snapshot of the present state; switches whose value
        is the same there are left alone (a generator step swaps worlds twice,
        so skipping no-op writes of flags and variables matters). ``layered``:
        the values go in force *over* ``unchanged`` (a world swapped in over its
        caller's): a switch with an override stack pushes them there, and
        restoring ``unchanged`` pops them again.
        """
        first_error: BaseException | None = None
        if unchanged is None:  # a block's exit: every switch, no comparisons
            for switch, saved in reversed(self._switches.values()):
                try:
                    switch.restore(saved)
                except BaseException as exc:
                    first_error = first_error or exc
        else:
            first_error = self._restore_switches_over(unchanged._switches, layered=layered)
        first_error = first_error or restore_sources(self._rng.values())
        if first_error is not None:
            raise first_error

    def _restore_switches_over(
        self, now: dict[str, tuple[_Part, Any]], *, layered: bool
    ) -> BaseException | None:
        first_error: BaseException | None = None
        for name, (switch, saved) in reversed(self._switches.items()):
            try:
                if name in now:
                    current = now[name][1]
                    if current == saved and getattr(saved, "override", None) is None:
                        continue
                    over = getattr(switch, "restore_over", None) if layered else None
                    if over is not None:
                        over(saved, current)
                        continue
                switch.restore(saved)
            except BaseException as exc:
                first_error = first_error or exc
        return first_error

    def renew_after_fork(self) -> None:
        """In a forked child: the Python ``random`` state this snapshot holds becomes a
        fresh one, as Python reseeds ``random`` in a child (so that parent and child do
        not draw the same numbers after the block that holds it)."""
        part = self._rng.get("python")
        if part is not None:
            self._rng["python"] = (part[0], random.Random().getstate())

    def keep_changes(self) -> None:
        """What was applied over this snapshot stays in force for good (``seed_all``):
        switches with an override stack let go of the override without undoing it."""
        self._each_override("keep")

    def lift_changes(self) -> None:
        """Take what was applied over this snapshot out of force until
        :meth:`reapply_changes` (a suspended generator parks its open block)."""
        self._each_override("lift")

    def reapply_changes(self) -> None:
        """Put what :meth:`lift_changes` took out back in force."""
        self._each_override("reapply")

    def _each_override(self, action: str) -> None:
        for switch, saved in self._switches.values():
            if getattr(saved, "override", None) is not None:
                getattr(switch, action)(saved)

    def state_dict(self) -> dict[str, Any]:
        """The captured RNG states as plain data for a checkpoint.

        Tensors, ints, floats, strings, ``None``, lists and dicts only, so
        ``torch.save`` then ``torch.load(..., weights_only=True)`` round-trips
        it. A device type that was not initialised is stored as the seed
        pending for it. See :mod:`detctx._state.state_dict` for each source's layout.
        Switch values are not part of it.
        """
        return state_dict.encode([(name, *part) for name, part in self._rng.items()])

    @classmethod
    def from_state_dict(
        cls,
        plain: Mapping[str, Any],
        *,
        strict: bool = True,
        sources: list[tuple[str, RNGSource]] | None = None,
    ) -> Snapshot:
        """The state a :meth:`state_dict` describes, bound to this process's sources.

        Restores nothing by itself; call :meth:`restore`. Raises
        :class:`~detctx.CheckpointError` (before any RNG is touched)
        for a dict of another format version, a source in the dict that is
        not registered here, a state that does not fit its source and, with
        ``strict`` (the default), a source managed here that the dict lacks.
        ``sources``: the ``(name, source)`` pairs to bind (default: every
        active source).
        """
        if sources is None:
            sources = active_sources()
        decoded = state_dict.decode(plain, sources, strict=strict)
        return cls({name: (source, state) for name, source, state in decoded})

    def fingerprint(self) -> str:
        """A 16-hex-digit digest of the captured RNG states (equal digests: equal states).

        States are digested by value (:mod:`detctx._state.values`): a device
        type captured before initialisation, as the seed pending for it, digests
        as the same device initialised with that seed and not drawn from.
        """
        return state_values.fingerprint(
            (name, source, state) for name, (source, state) in self._rng.items()
        )

    def source_fingerprints(self) -> dict[str, str]:
        """:meth:`fingerprint` of each captured source alone, by source name."""
        return {name: Snapshot({name: part}).fingerprint() for name, part in self._rng.items()}

    def __eq__(self, other: object) -> bool:
        """Equal when the same sources hold the same states by value, and the same switches
        were captured with the same values (see :meth:`fingerprint` for "by value")."""
        if not isinstance(other, Snapshot):
            return NotImplemented
        if list(self._rng) != list(other._rng) or self.switches != other.switches:
            return False
        return all(
            state_values.state_value(source, state) == state_values.state_value(*other._rng[name])
            for name, (source, state) in self._rng.items()
        )

    __hash__ = None  # type: ignore[assignment]

    def __getitem__(self, name: str) -> Any:
        return self._rng[name][1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rng)

    def __len__(self) -> int:
        return len(self._rng)

    def __repr__(self) -> str:
        return f"Snapshot(sources={list(self)}, fingerprint={self.fingerprint()!r})"


def capture() -> Snapshot:
    """Snapshot every managed RNG (Python, NumPy, torch CPU, each available
    accelerator, registered sources) without changing any of them, and
    without initialising a device the program has not used::

        state = detctx.capture()
        noisy_eval(model)
        state.restore()          # every RNG continues as if noisy_eval never ran
    """
    return Snapshot.capture()


def restore(state: Snapshot | Mapping[str, Any], *, strict: bool = True) -> None:
    """Put every RNG back into ``state``: a :class:`Snapshot` or its ``state_dict()``.

    A state dict is checked in full first (see :meth:`Snapshot.from_state_dict`),
    so a bad one raises :class:`~detctx.CheckpointError` with nothing changed.
    """
    if not isinstance(state, Snapshot):
        state = Snapshot.from_state_dict(state, strict=strict)
    state.restore()


def fingerprint() -> str:
    """A short hex digest of all current RNG states: equal digests mean equal states."""
    return Snapshot.capture().fingerprint()


def restore_sources(parts: Iterable[tuple[RNGSource, Any]]) -> BaseException | None:
    """Restore each ``(source, state)``, attempting every one; the first failure, returned."""
    first_error: BaseException | None = None
    for source, state in parts:
        try:
            source.restore(state)
        except BaseException as exc:
            first_error = first_error or exc
    return first_error
