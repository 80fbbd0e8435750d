"""Determinism switches: algorithm flags and environment variables.

Each switch follows the RNG sources' shape: ``capture()`` the current value,
``apply(setting, seed, current)`` the deterministic one, ``restore(saved)``
the old one. The switch options are declared once, in :class:`SwitchOptions`
(the keywords of ``deterministic``, ``seed_all`` and
``distributed_deterministic``), and implemented once, in :data:`SWITCHES`; a
new switch is one entry in each. A switch's setting is validated once, when a
block is configured, so a bad option fails before anything is changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, Protocol

import torch

from detctx._basics import DeterminismWarning, warn_at_user
from detctx._environment import ENV_SWITCHES, EnvSwitch, EnvSwitchOptions, env_switches, inductor
from detctx._sources import active_accelerators
from detctx._switches.npu_level import NpuLevelSwitch
from detctx._switches.overrides import Level, Override, OverrideStack

__all__ = [
    "ALGORITHMS",
    "SWITCHES",
    "AlgorithmsSwitch",
    "CudnnSwitch",
    "EnvSwitch",
    "EnvSwitchOptions",
    "NpuLevelSwitch",
    "Switch",
    "SwitchOptions",
    "default_setting",
    "env_switches",
    "switch_names",
    "validate_switches",
]


class SwitchOptions(EnvSwitchOptions, total=False):
    """Every switch a block sets, as keyword arguments (``**switches``).

    Each is on (``True``) unless turned off with ``False``.
    """

    algorithms: bool | Literal["warn"]
    """``torch.use_deterministic_algorithms(True)``; ``"warn"`` for ``warn_only=True``."""
    cudnn: bool
    """``torch.backends.cudnn.deterministic = True`` and ``benchmark = False``."""
    npu_level: Literal[1, 2, 3] | None
    """torch_npu's ``set_deterministic_level``: 1, 2 (strong consistency) or 3 (batch
    consistency); ``None`` (the default) follows ``algorithms``."""


class Switch(Protocol):
    """One determinism setting detctx can save, set and put back."""

    @property
    def name(self) -> str:
        """The switch's keyword (a key of :class:`SwitchOptions`)."""

    def validate(self, setting: object) -> None:
        """Raise ``TypeError`` / ``ValueError`` for a setting this switch does not accept."""

    def capture(self) -> Any: ...

    def apply(self, setting: Any, seed: int, current: Any) -> str | None:
        """Set the switch; return a short description for the log, or None if left alone.

        ``current`` is what ``capture()`` returned just before (saves reading it twice).
        """

    def restore(self, saved: Any) -> None: ...


def _check_bool(name: str, setting: object) -> None:
    if not isinstance(setting, bool):
        raise TypeError(f"{name} must be True or False, got {setting!r}")


class AlgorithmsSwitch:
    """``torch.use_deterministic_algorithms`` (and ``fill_uninitialized_memory``).

    ``True`` raises on ops without a deterministic implementation, ``"warn"``
    only warns (``warn_only=True``), ``False`` leaves the flags alone. Like
    torch's own call it also makes ``torch._inductor.config.deterministic``
    follow the block, without importing inductor (see :mod:`detctx._environment.inductor`):
    ``torch.compile`` inside the block compiles deterministically, and after
    the block inductor has the caller's value again.

    On Ascend NPUs the deterministic state is taken once per thread, by the
    first setting that is followed by an op launch; after that, turning it on
    or back off is best-effort, and a warning says so.

    The flag has one owner: its :class:`~detctx._switches.overrides.OverrideStack`.
    A capture is a :class:`~detctx._switches.overrides.Level`; ``apply`` pushes an
    override over it (even with ``False``, which changes nothing, so that the
    exit still pops in turn with regions in other threads), and restoring the
    level pops it. ``deterministic_region`` pushes and pops the same stack.
    """

    name = "algorithms"

    def __init__(self) -> None:
        utils_det = getattr(torch.utils, "deterministic", None)
        self._fill = utils_det if hasattr(utils_det, "fill_uninitialized_memory") else None
        # torch.use_deterministic_algorithms imports torch._inductor (see inductor.py);
        # the C setter it ends with is all the flags need. Older torch may lack it.
        self._set_flags: Callable[..., None] = getattr(
            torch._C, "_set_deterministic_algorithms", torch.use_deterministic_algorithms
        )
        self._stack = OverrideStack(self._read, self._put, self._switch_on)

    def validate(self, setting: object) -> None:
        if isinstance(setting, str):
            if setting != "warn":
                raise ValueError(f"algorithms must be True, False or 'warn', got {setting!r}")
        else:
            _check_bool("algorithms", setting)

    def _read(self) -> tuple[Any, ...]:
        fill = self._fill.fill_uninitialized_memory if self._fill is not None else None
        return (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            fill,
            inductor.capture(),
        )

    def capture(self) -> Level:
        return self._stack.level()

    def apply(self, setting: Any, seed: int, current: Any) -> str | None:
        self._stack.push(setting, current if isinstance(current, Level) else None)
        if setting is False:
            return None
        return "algorithms=warn" if setting == "warn" else "algorithms=on"

    def restore(self, saved: Any) -> None:
        if isinstance(saved, Level):
            self._stack.restore(saved)
        else:
            self._put(tuple(saved))

    def restore_over(self, saved: Any, current: Any) -> None:
        """Put ``saved`` in force over ``current`` (a world swapped in over its caller's
        level): restoring ``current`` pops it again."""
        flags = saved.flags if isinstance(saved, Level) else tuple(saved)
        self._stack.push(flags, current if isinstance(current, Level) else None)

    def keep(self, saved: Any) -> None:
        """Leave what was applied over ``saved`` in force for good (``seed_all``)."""
        if isinstance(saved, Level):
            self._stack.keep(saved)

    def override(self, setting: Any) -> Override:
        """Switch the flag on as ``setting`` asks until :meth:`end_override`
        (``deterministic_region``, from any thread)."""
        return self._stack.push(_Region(setting))

    def end_override(self, override: Override) -> None:
        self._stack.pop(override)

    def lift(self, saved: Any) -> None:
        """Take what was applied over ``saved`` out of force (a generator parks its block)."""
        override = saved.override if isinstance(saved, Level) else None
        if override is not None:
            self._stack.lift(override)

    def reapply(self, saved: Any) -> None:
        """Put what was lifted back in force (the generator resumes)."""
        override = saved.override if isinstance(saved, Level) else None
        if override is not None:
            self._stack.reapply(override)

    def overrides_in_force(self) -> int:
        """How many blocks, worlds and regions hold the flag now."""
        return self._stack.in_force()

    def _switch_on(self, setting: Any, current: Any) -> None:
        """Put ``setting`` in force over the flags ``current``: a block's setting, a
        region's (:class:`_Region`: left alone when already on), or flags (a world's)."""
        if setting is False:
            return
        if isinstance(setting, tuple):
            if current != setting:
                self._put(setting)
            return
        if isinstance(setting, _Region):
            setting = setting.setting
            if current[:2] == (True, setting == "warn"):
                return
        warn_only = setting == "warn"
        if current[:2] != (True, warn_only) and _npu_initialized():
            warn_at_user(
                "torch.use_deterministic_algorithms was changed after the NPU was initialised; "
                "Ascend reads the deterministic state once per thread, at the first op launch "
                "that follows a setting, so this change may not take effect on the NPU (and "
                "restoring it on exit is best-effort). Enter the block, or call "
                "detctx.seed_all(), before the first NPU op.",
                DeterminismWarning,
            )
        inductor.switch_on(current[3])
        self._set_flags(True, warn_only=warn_only)

    def _put(self, saved: Any) -> None:
        enabled, warn_only, fill, compiled = saved
        now = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        if now != (enabled, warn_only):
            self._set_flags(enabled, warn_only=warn_only)
        inductor.restore(compiled)
        # Written through torch's config module: slow, so only when it changed.
        if (
            self._fill is not None
            and fill is not None
            and self._fill.fill_uninitialized_memory != fill
        ):
            self._fill.fill_uninitialized_memory = fill


class _Region:
    """A region's setting: switched on only where the flags are not on already."""

    __slots__ = ("setting",)

    def __init__(self, setting: Any) -> None:
        self.setting = setting


class CudnnSwitch:
    """``torch.backends.cudnn.deterministic = True`` and ``.benchmark = False``."""

    name = "cudnn"

    def validate(self, setting: object) -> None:
        _check_bool("cudnn", setting)

    def capture(self) -> Any:
        cudnn = torch.backends.cudnn
        return (cudnn.deterministic, cudnn.benchmark)

    def apply(self, setting: Any, seed: int, current: Any) -> str | None:
        if not setting:
            return None
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        return "cudnn.deterministic=True, cudnn.benchmark=False"

    def restore(self, saved: Any) -> None:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def _npu_initialized() -> bool:
    # Ascend reads the deterministic state once per thread (see AlgorithmsSwitch).
    return any(acc.device_type == "npu" and acc.is_initialized() for acc in active_accelerators())


ALGORITHMS: Final = AlgorithmsSwitch()
"""The ``algorithms`` switch: its override stack is shared with ``deterministic_region``."""

SWITCHES: Final[tuple[Switch, ...]] = (
    ALGORITHMS,
    # After algorithms (restored before it): torch_npu's level drags torch's flag along.
    NpuLevelSwitch(),
    CudnnSwitch(),
    *ENV_SWITCHES,
)
"""Every switch a block manages, in the order they are applied (restored in reverse)."""


def switch_names() -> list[str]:
    """The switches' keywords, in order."""
    return [switch.name for switch in SWITCHES]


def default_setting(name: str) -> object:
    """The setting of switch ``name`` when none is given: ``True`` (on), unless the
    switch declares its own ``default`` (``npu_level``'s is ``None``)."""
    return _default_of(_BY_NAME[name])


def _default_of(switch: Switch) -> object:
    return getattr(switch, "default", True)


def validate_switches(
    given: Mapping[str, object], *, caller: str, only: Mapping[str, Switch] | None = None
) -> dict[str, object]:
    """Every switch's setting: ``given``, checked, with the rest at their default (on).

    ``only`` limits the accepted switches (``prepare_environment`` takes the
    environment ones). Raises ``TypeError`` naming ``caller`` for an unknown
    keyword, and the switch's own ``TypeError`` / ``ValueError`` for a bad
    setting, before anything is changed.
    """
    accepted = only if only is not None else _BY_NAME
    unknown = [name for name in given if name not in accepted]
    if unknown:
        raise TypeError(
            f"{caller}() got an unexpected keyword argument {unknown[0]!r}; the switches it "
            f"takes are {', '.join(accepted)}"
        )
    settings: dict[str, object] = {}
    for name, switch in accepted.items():
        setting = given.get(name, _default_of(switch))
        switch.validate(setting)
        settings[name] = setting
    return settings


_BY_NAME: Final[dict[str, Switch]] = {switch.name: switch for switch in SWITCHES}
