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

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import torch
from typing_extensions import TypedDict

from detctx import _inductor as inductor
from detctx._accelerators import active_accelerators
from detctx._environment import getenv, setenv
from detctx._errors import DeterminismWarning
from detctx._npu_level import NpuLevelSwitch

__all__ = [
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


class EnvSwitchOptions(TypedDict, total=False):
    """The environment-variable switches (also taken by ``prepare_environment``).

    Each is on (``True``) unless turned off with ``False``.
    """

    hash_seed: bool
    """``PYTHONHASHSEED=str(seed)`` for child processes (overwrites a user value)."""
    cublas_workspace: bool
    """``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (a user's ``:16:8`` is kept)."""
    hccl: bool | Literal["strict"]
    """``HCCL_DETERMINISTIC=true``; ``"strict"`` for ``strict`` (a user's ``strict`` is kept)."""
    matmul_k_shift: bool
    """``CLOSE_MATMUL_K_SHIFT=1`` (Ascend's matmul reduction order)."""
    flash_attention: bool
    """``FLASH_ATTENTION_DETERMINISTIC=1`` (read by HF transformers)."""


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
    follow the block, without importing inductor (see :mod:`detctx._inductor`):
    ``torch.compile`` inside the block compiles deterministically, and after
    the block inductor has the caller's value again.

    On Ascend NPUs the deterministic state is taken once per thread, by the
    first setting that is followed by an op launch; after that, turning it on
    or back off is best-effort, and a warning says so.
    """

    name = "algorithms"

    def __init__(self) -> None:
        utils_det = getattr(torch.utils, "deterministic", None)
        self._fill = utils_det if hasattr(utils_det, "fill_uninitialized_memory") else None
        # torch.use_deterministic_algorithms imports torch._inductor (see detctx._inductor);
        # the C setter it ends with is all the flags need. Older torch may lack it.
        self._set_flags: Callable[..., None] = getattr(
            torch._C, "_set_deterministic_algorithms", torch.use_deterministic_algorithms
        )

    def validate(self, setting: object) -> None:
        if isinstance(setting, str):
            if setting != "warn":
                raise ValueError(f"algorithms must be True, False or 'warn', got {setting!r}")
        else:
            _check_bool("algorithms", setting)

    def capture(self) -> Any:
        fill = self._fill.fill_uninitialized_memory if self._fill is not None else None
        return (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            fill,
            inductor.capture(),
        )

    def apply(self, setting: Any, seed: int, current: Any) -> str | None:
        if setting is False:
            return None
        warn_only = setting == "warn"
        if current[:2] != (True, warn_only) and _npu_initialized():
            warnings.warn(
                "torch.use_deterministic_algorithms was changed after the NPU was initialised; "
                "Ascend reads the deterministic state once per thread, at the first op launch "
                "that follows a setting, so this change may not take effect on the NPU (and "
                "restoring it on exit is best-effort). Enter the block, or call "
                "detctx.seed_all(), before the first NPU op.",
                DeterminismWarning,
                stacklevel=5,
            )
        inductor.switch_on(current[3])
        self._set_flags(True, warn_only=warn_only)
        return "algorithms=warn" if warn_only else "algorithms=on"

    def restore(self, saved: Any) -> None:
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


@dataclass(frozen=True)
class EnvSwitch:
    """An environment variable set for the block and restored (or unset) after it.

    ``values`` maps each accepted setting (other than ``False``) to the value
    written; a current value in ``keep`` already satisfies the setting and is
    left as it is. ``off`` is the value that turns the variable's feature off,
    for a variable whose reader has one: never written, but a value the reader
    accepts (``detctx doctor`` tells it from a typo). ``too_late`` says, when
    the variable is actually changed, whether the process has passed the point
    where it is read, and returns the reason for the warning.
    """

    name: str
    variable: str
    values: dict[object, str | Callable[[int], str]]
    keep: frozenset[str] = frozenset()
    off: str | None = None
    too_late: Callable[[], str | None] | None = None

    @property
    def on_values(self) -> frozenset[str]:
        """The fixed values that turn the feature on: those written (when not derived
        from the seed) and those kept."""
        return self.keep | {value for value in self.values.values() if isinstance(value, str)}

    @property
    def accepted_values(self) -> frozenset[str]:
        """Every fixed value the variable's reader accepts: :attr:`on_values` and ``off``."""
        return self.on_values | ({self.off} if self.off is not None else set())

    def validate(self, setting: object) -> None:
        if setting is False:
            return
        if isinstance(setting, bool) or isinstance(setting, str):
            if setting in self.values:
                return
        accepted = ", ".join(repr(v) for v in [False, *self.values])
        if isinstance(setting, (bool, str)):
            raise ValueError(f"{self.name} must be one of {accepted}, got {setting!r}")
        raise TypeError(f"{self.name} must be one of {accepted}, got {setting!r}")

    def capture(self) -> Any:
        return getenv(self.variable)

    def target(self, setting: Any, seed: int, current: str | None) -> str | None:
        """The value the variable must hold for ``setting``; ``current`` when it already
        satisfies it, None when the setting is ``False`` (leave the variable alone)."""
        if setting is False:
            return None
        value = self.values[setting]
        wanted = value(seed) if callable(value) else value
        if current is not None and current.strip().lower() in self.keep | {wanted.lower()}:
            return current
        return wanted

    def apply(self, setting: Any, seed: int, current: Any) -> str | None:
        wanted = self.target(setting, seed, current)
        if wanted is None:
            return None
        if current != wanted:
            reason = self.too_late() if self.too_late is not None else None
            if reason is not None:
                warnings.warn(
                    f"{self.variable} was set to {wanted!r} after {reason}, so it may not take "
                    f"effect in this process. Set it before launch: "
                    f"export {self.variable}={wanted}",
                    DeterminismWarning,
                    stacklevel=5,
                )
            os.environ[self.variable] = wanted
        return f"{self.variable}={wanted}"

    def restore(self, saved: Any) -> None:
        setenv(self.variable, saved)


def _cuda_initialised() -> str | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return "CUDA was initialised (cuBLAS reads it when it creates its first handle)"
    return None


def _hccl_communicator_exists() -> str | None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and "hccl" in str(dist.get_backend()).lower():
        return (
            "the HCCL process group was created (torch_npu reads it once, when the first "
            "communicator is configured)"
        )
    return None


def _npu_initialized() -> bool:
    # Ascend reads the deterministic state once per thread (see AlgorithmsSwitch).
    return any(acc.device_type == "npu" and acc.is_initialized() for acc in active_accelerators())


SWITCHES: Final[tuple[Switch, ...]] = (
    AlgorithmsSwitch(),
    # After algorithms (restored before it): torch_npu's level drags torch's flag along.
    NpuLevelSwitch(),
    CudnnSwitch(),
    EnvSwitch("hash_seed", "PYTHONHASHSEED", {True: str}),
    EnvSwitch(
        "cublas_workspace",
        "CUBLAS_WORKSPACE_CONFIG",
        {True: ":4096:8"},
        keep=frozenset({":4096:8", ":16:8"}),
        too_late=_cuda_initialised,
    ),
    EnvSwitch(
        "hccl",
        "HCCL_DETERMINISTIC",
        {True: "true", "strict": "strict"},
        keep=frozenset({"strict"}),
        off="false",
        too_late=_hccl_communicator_exists,
    ),
    EnvSwitch("matmul_k_shift", "CLOSE_MATMUL_K_SHIFT", {True: "1"}),
    EnvSwitch("flash_attention", "FLASH_ATTENTION_DETERMINISTIC", {True: "1"}),
)
"""Every switch a block manages, in the order they are applied (restored in reverse)."""


def env_switches() -> list[EnvSwitch]:
    """The environment-variable switches alone, for setting up a launch's environment."""
    return [switch for switch in SWITCHES if isinstance(switch, EnvSwitch)]


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
