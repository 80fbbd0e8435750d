"""The environment-variable switches, without torch.

They are part of :data:`detctx._switches.table.SWITCHES` and are also what
``detctx run`` and launchers export to the commands they start. ``detctx
run`` must not import torch (its import swallowed a Ctrl-C at start-up in 3
of 35 tries, and costs seconds), so this module reads torch's state only
when something else has imported it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from typing_extensions import TypedDict

from detctx._basics import DeterminismWarning, warn_at_user
from detctx._environment.variables import getenv, setenv

__all__ = ["ENV_SWITCHES", "EnvSwitch", "EnvSwitchOptions", "env_switches"]


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

    def spelling(self, current: str, wanted: str) -> str | None:
        """The exact value ``current`` stands for among ``wanted`` and :attr:`keep`, or None.

        ``current`` itself when it is one of them as written; the value it names
        when it differs only by surrounding whitespace or letter case (``' :16:8'``,
        ``':16:8\\n'``, ``'STRICT'``), since the readers compare what they read
        exactly: torch's cuBLAS check is a string equality (aten ``Context.cpp``,
        ``checkCuBLASConfigDeterministic``), so ``' :16:8'`` makes every cuBLAS op
        under ``use_deterministic_algorithms`` raise, and Python refuses to start
        with ``PYTHONHASHSEED='5 '``.
        """
        accepted = (wanted, *sorted(self.keep))
        if current in accepted:
            return current
        loose = current.strip().lower()
        return next((value for value in accepted if value.lower() == loose), None)

    def target(self, setting: Any, seed: int, current: str | None) -> str | None:
        """The value the variable must hold for ``setting``, exactly as its reader accepts
        it: ``current`` when it already is such a value, its exact spelling when it is
        one but for whitespace or letter case (:meth:`spelling`), else the value written.
        None when the setting is ``False`` (leave the variable alone)."""
        if setting is False:
            return None
        value = self.values[setting]
        wanted = value(seed) if callable(value) else value
        kept = self.spelling(current, wanted) if current is not None else None
        return wanted if kept is None else kept

    def apply(self, setting: Any, seed: int, current: Any) -> str | None:
        wanted = self.target(setting, seed, current)
        if wanted is None:
            return None
        if current != wanted:
            reason = self.too_late() if self.too_late is not None else None
            if reason is not None:
                warn_at_user(
                    f"{self.variable} was set to {wanted!r} after {reason}, so it may not take "
                    f"effect in this process. Set it before launch: "
                    f"export {self.variable}={wanted}",
                    DeterminismWarning,
                )
            os.environ[self.variable] = wanted
        return f"{self.variable}={wanted}"

    def restore(self, saved: Any) -> None:
        setenv(self.variable, saved)


def _cuda_initialised() -> str | None:
    torch = sys.modules.get("torch")  # not imported: nothing can have initialised CUDA
    if torch is None:
        return None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "CUDA was initialised (cuBLAS reads it when it creates its first handle)"
    return None


def _hccl_communicator_exists() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and "hccl" in str(dist.get_backend()).lower():
        return (
            "the HCCL process group was created (torch_npu reads it once, when the first "
            "communicator is configured)"
        )
    return None


ENV_SWITCHES: Final[tuple[EnvSwitch, ...]] = (
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
"""The environment-variable switches, in the order they are applied."""


def env_switches() -> list[EnvSwitch]:
    """The environment-variable switches alone, for setting up a launch's environment."""
    return list(ENV_SWITCHES)
