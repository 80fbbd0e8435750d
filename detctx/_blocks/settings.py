"""A block's validated configuration, and the record of what one entry applied.

:class:`Settings` is what ``deterministic(...)``, ``seed_all(...)`` and the
decorator forms hold: the seed (or ``None``) and one setting per switch, all
checked when they are given. :meth:`Settings.apply` seeds every source and
sets every switch, and returns a :class:`Seeding`: the seed used, the sources
seeded and the switches set, which is also the log line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from detctx._basics import note_entry, resolve_seed, validate_seed
from detctx._state import Snapshot
from detctx._switches import SWITCHES, default_setting, validate_switches

__all__ = ["ALONE", "Coordinator", "Entry", "Seeding", "Settings"]

logger = logging.getLogger("detctx")


@dataclass(frozen=True)
class Seeding:
    """What one entry of a block (or one ``seed_all`` call) applied.

    ``seed`` is the seed used: with ``seed=None`` it is the one read from
    ``DETCTX_SEED`` or drawn from OS entropy, so the run can be repeated with
    ``deterministic(seed=seeding.seed)``. ``sources`` names the RNG sources
    seeded, ``switches`` describes the switches set, and names those turned
    off (``"algorithms=off"``)::

        with detctx.deterministic(seed=None) as seeding:
            print(seeding.seed)          # e.g. 2718281828: rerun with this seed
    """

    seed: int
    sources: tuple[str, ...]
    switches: tuple[str, ...]

    def describe(self) -> str:
        """The log line's text: seed, sources and switches."""
        return (
            f"seed={self.seed}; sources: {', '.join(self.sources)}; "
            f"switches: {', '.join(self.switches) or 'none'}"
        )


class Entry(Protocol):
    """One entry's seed, decided before anything changes, and the record it makes."""

    @property
    def seed(self) -> int: ...

    def record(self, seeding: Seeding) -> Seeding:
        """The record of what the entry applied (``seeding``, or a richer one)."""
        ...


class Coordinator(Protocol):
    """How a block decides each entry's seed and checks its entry and exit.

    Alone (:data:`ALONE`, the default), or with the other ranks of a process
    group (:mod:`detctx.distributed`): a new way of agreeing is a coordinator,
    not a branch in the block.
    """

    def begin(self, settings: Settings) -> Entry:
        """Decide the seed of one entry; may communicate, changes nothing."""
        ...

    def after_entry(self) -> None:
        """Check the entry once everything is seeded (may raise; the block is then closed)."""
        ...

    def before_exit(self, owner: object, raised: BaseException | None) -> None:
        """Check the exit of ``owner``'s block before anything is restored; ``raised``:
        what the body raised."""
        ...

    def options(self) -> dict[str, object]:
        """The options not left at their default, for the block's ``repr``."""
        ...


class _Resolved:
    """The seed of one entry of a block of one process (a plain class: made on every entry)."""

    __slots__ = ("seed",)

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def record(self, seeding: Seeding) -> Seeding:
        return seeding


class _Alone:
    """A block of one process: the configured seed, ``$DETCTX_SEED`` or a fresh one."""

    def begin(self, settings: Settings) -> Entry:
        seed = resolve_seed(settings.seed)
        note_entry(seed, given=settings.seed is not None)  # for detctx run, before seeding
        return _Resolved(seed)

    def after_entry(self) -> None:
        pass

    def before_exit(self, owner: object, raised: BaseException | None) -> None:
        pass

    def options(self) -> dict[str, object]:
        return {}


ALONE: Coordinator = _Alone()
"""The coordinator of ``deterministic`` and ``seed_all``."""


class Settings:
    """The validated seed and switch settings of one configuration.

    ``seed`` is an int in ``[0, 2**32 - 1]`` or ``None`` (resolved on each
    entry); ``switches`` maps every switch name to its setting; ``coordinator``
    decides each entry's seed. Bad values raise ``TypeError`` / ``ValueError``
    here, naming ``caller``.
    """

    __slots__ = ("coordinator", "seed", "switches")

    def __init__(
        self,
        seed: object,
        switches: Mapping[str, object],
        *,
        caller: str,
        coordinator: Coordinator = ALONE,
    ) -> None:
        self.seed = None if seed is None else validate_seed(seed)
        self.switches = validate_switches(switches, caller=caller)
        self.coordinator = coordinator

    def begin(self) -> Entry:
        """Decide one entry's seed (the coordinator's part; nothing is changed)."""
        return self.coordinator.begin(self)

    def changed(self) -> dict[str, object]:
        """The switches not left at their default (on, or the switch's own), for a ``repr``."""
        return {
            name: value
            for name, value in self.switches.items()
            if value is not default_setting(name)
        }

    def apply(self, entry: Entry, current: Snapshot) -> Seeding:
        """Seed every source ``current`` holds with the entry's seed, set every switch,
        and log what was applied.

        ``current`` is the snapshot taken just before (with switches): its
        switch values are reused instead of being read again.
        """
        seed = entry.seed
        sources = current.sources
        for _, source in sources:
            source.seed(seed)
        applied = []
        for switch in SWITCHES:
            description = switch.apply(
                self.switches[switch.name], seed, current.switch_value(switch.name)
            )
            if description is not None:
                applied.append(description)
            elif self.switches[switch.name] is False:
                # Said, not left out: a reader of the log must not take it for a default.
                applied.append(f"{switch.name}=off")
        seeding = entry.record(Seeding(seed, tuple(name for name, _ in sources), tuple(applied)))
        if logger.isEnabledFor(logging.INFO):
            logger.info("deterministic computing is applied: %s", seeding.describe())
        return seeding
