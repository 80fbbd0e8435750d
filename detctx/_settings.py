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
from typing import Any

from detctx._seeds import resolve_seed, validate_seed
from detctx._snapshot import Snapshot
from detctx._sources import RNGSource
from detctx._switches import SWITCHES, Switch, default_setting, validate_switches

__all__ = ["Seeding", "Settings"]

logger = logging.getLogger("detctx")


@dataclass(frozen=True)
class Seeding:
    """What one entry of a block (or one ``seed_all`` call) applied.

    ``seed`` is the seed used: with ``seed=None`` it is the one read from
    ``DETCTX_SEED`` or drawn from OS entropy, so the run can be repeated with
    ``deterministic(seed=seeding.seed)``. ``sources`` names the RNG sources
    seeded, ``switches`` describes the switches set::

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


class Settings:
    """The validated seed and switch settings of one configuration.

    ``seed`` is an int in ``[0, 2**32 - 1]`` or ``None`` (resolved on each
    entry); ``switches`` maps every switch name to its setting. Bad values
    raise ``TypeError`` / ``ValueError`` here, naming ``caller``.
    """

    __slots__ = ("seed", "switches")

    def __init__(self, seed: object, switches: Mapping[str, object], *, caller: str) -> None:
        self.seed = None if seed is None else validate_seed(seed)
        self.switches = validate_switches(switches, caller=caller)

    def resolve_seed(self) -> int:
        """The seed for one entry: the configured one, else ``$DETCTX_SEED`` or a fresh one."""
        return resolve_seed(self.seed)

    def changed(self) -> dict[str, object]:
        """The switches not left at their default (on, or the switch's own), for a ``repr``."""
        return {
            name: value
            for name, value in self.switches.items()
            if value is not default_setting(name)
        }

    def apply(
        self, sources: list[tuple[str, RNGSource]], seed: int, current: Snapshot | None = None
    ) -> Seeding:
        """Seed every source with ``seed``, set every switch, and log what was applied.

        ``current``, if given, is a snapshot with switches taken just before:
        its switch values are reused instead of being read again.
        """
        for _, source in sources:
            source.seed(seed)
        applied = []
        for switch in SWITCHES:
            description = switch.apply(
                self.switches[switch.name], seed, _current_value(switch, current)
            )
            if description is not None:
                applied.append(description)
        seeding = Seeding(seed, tuple(name for name, _ in sources), tuple(applied))
        if logger.isEnabledFor(logging.INFO):
            logger.info("deterministic computing is applied: %s", seeding.describe())
        return seeding


def _current_value(switch: Switch, current: Snapshot | None) -> Any:
    if current is None:
        return switch.capture()
    return current.switch_value(switch.name)
