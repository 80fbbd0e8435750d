"""The launcher's part: the read-once environment variables, set before workers start."""

from __future__ import annotations

import os
from typing import Final

from typing_extensions import Unpack

from detctx._basics import SEED_ENV, validate_seed
from detctx._environment import EnvSwitch, EnvSwitchOptions, env_switches, setenv
from detctx._state import transaction
from detctx._switches import validate_switches
from detctx.distributed._topology import warn_superpod

__all__ = ["prepare_environment"]

_ENV_SWITCHES: Final[dict[str, EnvSwitch]] = {switch.name: switch for switch in env_switches()}


class _Variables:
    """The values of the variables ``prepare_environment`` may set, to put back on failure."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        names = [switch.variable for switch in _ENV_SWITCHES.values()] + [SEED_ENV]
        self.values = {name: os.environ.get(name) for name in names}

    def restore_each(self) -> None:
        for name, value in self.values.items():
            setenv(name, value)


def prepare_environment(
    seed: int | None = None, **switches: Unpack[EnvSwitchOptions]
) -> dict[str, str]:
    """Set the determinism environment variables, and nothing else, for a launch.

    Call it in the launcher before ``init_process_group`` (and before any
    CUDA or NPU work, and before starting the worker processes, which inherit
    it): it sets each variable of :class:`detctx.EnvSwitchOptions` as a block
    does (the values are listed there); ``False`` leaves a variable alone.
    ``PYTHONHASHSEED`` (``hash_seed``) needs a ``seed``, and is set only with
    one, as is ``DETCTX_SEED`` (read by ``seed=None`` blocks on the source
    rank). Nothing is seeded and nothing is restored. Returns the variables it
    manages with their values.
    Warns when a variable is set after the point where it is read (a CUDA
    context or an HCCL group already exists), and when ``HCCL_LOGIC_SUPERPOD_ID``
    is set. If anything fails (a warning turned into an error, a Ctrl-C),
    every variable it set is put back before the error propagates.
    """
    checked = None if seed is None else validate_seed(seed)
    settings = validate_switches(switches, caller="prepare_environment", only=_ENV_SWITCHES)
    if checked is None:
        # PYTHONHASHSEED needs a seed to write; without one it is left alone.
        settings["hash_seed"] = False
    if settings["hccl"] is not False:
        warn_superpod()

    def make(before: _Variables) -> dict[str, str]:
        applied: dict[str, str] = {}
        for name, switch in _ENV_SWITCHES.items():
            if switch.apply(settings[name], checked or 0, switch.capture()) is not None:
                applied[switch.variable] = os.environ[switch.variable]
        if checked is not None:
            os.environ[SEED_ENV] = str(checked)
            applied[SEED_ENV] = str(checked)
        return applied

    return transaction.change(make, _Variables, lasts=transaction.Lasts.DONE)
