"""The ``npu_level`` switch: torch_npu's determinism level (1, 2 or 3) for a block.

torch_npu keeps one level per process (``torch_npu.npu.set_deterministic_level``,
read back with ``_get_deterministic_level``): 0 off, 1 deterministic, 2 strong
consistency (a result does not depend on where the data sits), 3 batch
consistency (a sample's result does not depend on its batch; newest chips and
runtimes only). It keeps the level in step with
``torch.use_deterministic_algorithms``: setting 0 turns torch's flag off,
setting 1 or more turns it on. So this switch is applied after the
``algorithms`` switch and restored before it: putting the level back first lets
the ``algorithms`` switch see, and correct, whatever torch_npu did to the flag.
"""

from __future__ import annotations

import warnings
from typing import Any, Final

import torch

from detctx._basics import DeterminismUnavailableError, DeterminismWarning, as_integer, warn_at_user
from detctx._sources import active_accelerators

__all__ = [
    "LEVEL_API_VERSIONS",
    "NPU_LEVELS",
    "NpuLevelSwitch",
    "describe_npu_level",
    "npu_level_api",
]

NPU_LEVELS: Final = (1, 2, 3)
"""The levels a block can ask for (``None``: follow the ``algorithms`` switch)."""

LEVEL_API_VERSIONS: Final = (
    "torch_npu 2.6.0.post6, 2.7.1.post3, 2.8.0.post3, 2.9.0.post1 or 2.10.0 and later "
    "(Ascend Extension for PyTorch 7.3.1 / 26.0.0)"
)
"""The first torch_npu releases with ``set_deterministic_level``."""

# torch_npu warns on every set_deterministic_level call, telling the caller to stop
# using torch.use_deterministic_algorithms, and again when the level and torch's
# flag disagree. Both are about detctx's own bookkeeping calls, which keep the two in
# step: reproduce with `python -c "import torch_npu; torch_npu.npu.set_deterministic_level(1)"`.
_TORCH_NPU_NOISE: Final = r".*(set_deterministic_level|torch\.use_deterministic_algorithms).*"


def npu_level_api() -> tuple[Any, Any] | None:
    """``(set_deterministic_level, _get_deterministic_level)`` of the NPU's device
    module, or None when there is no NPU or its torch_npu predates them."""
    for accelerator in active_accelerators():
        if accelerator.device_type == "npu":
            setter = getattr(accelerator.module, "set_deterministic_level", None)
            getter = getattr(accelerator.module, "_get_deterministic_level", None)
            if setter is None or getter is None:
                return None
            return setter, getter
    return None


def describe_npu_level() -> int | str | None:
    """The process's NPU determinism level for a report: the level, a sentence when
    torch_npu lacks the API, or None without an NPU."""
    api = npu_level_api()
    if api is not None:
        return int(_quietly(api[1]))
    if _npu_present():
        return f"not in this torch_npu (needs {LEVEL_API_VERSIONS})"
    return None


def _npu_present() -> bool:
    return any(accelerator.device_type == "npu" for accelerator in active_accelerators())


def _quietly(call: Any, *args: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TORCH_NPU_NOISE)
        return call(*args)


class NpuLevelSwitch:
    """torch_npu's determinism level: ``None`` (follow ``algorithms``), 1, 2 or 3.

    Saved: the process's level (``_get_deterministic_level()``), where an NPU
    and the API exist. Set: ``set_deterministic_level(level)``, which also
    turns ``torch.use_deterministic_algorithms`` on (restored on exit by the
    ``algorithms`` switch, even with ``algorithms=False``). Restored: the
    saved level (0 and 1, which torch_npu keeps equal to torch's flag, through
    the ``algorithms`` switch; so ``None`` never calls torch_npu). Best-effort:
    without an NPU it does nothing (the log line says so); with a torch_npu
    that predates the API, level 1 is
    ``torch.use_deterministic_algorithms(True)`` and 2 or 3 warn
    (:class:`~detctx.DeterminismWarning`) and fall back to it::

        with detctx.deterministic(seed=0, npu_level=2):   # strong consistency
            train(model, loader)
    """

    name = "npu_level"
    default = None

    def validate(self, setting: object) -> None:
        if setting is None:
            return
        if as_integer(setting) is None:  # NumPy integers too, as seeds
            raise TypeError(f"npu_level must be None, 1, 2 or 3, got {setting!r}")
        if as_integer(setting) not in NPU_LEVELS:
            raise ValueError(
                f"npu_level must be None, 1, 2 or 3, got {setting!r}; to switch determinism "
                "off in a block, leave npu_level=None and pass algorithms=False"
            )

    def capture(self) -> Any:
        api = npu_level_api()
        if api is None:
            return None
        # _get_deterministic_level re-syncs the level with torch's flag first (0 with the
        # flag on reads as 1), so the saved level agrees with the saved algorithms flag.
        return int(_quietly(api[1]))

    def apply(self, setting: Any, seed: int, current: Any) -> str | None:
        if setting is None:
            return None
        setting = as_integer(setting)
        api = npu_level_api()
        if api is not None:
            if current != setting:
                try:
                    _quietly(api[0], setting)
                except RuntimeError as exc:
                    raise DeterminismUnavailableError(
                        f"torch_npu refused npu_level={setting} ({exc}); level 3 needs a chip "
                        "and CANN runtime with batch consistency: use npu_level=2 (or 1)"
                    ) from exc
            return f"npu_level={setting}"
        if not _npu_present():
            return f"npu_level={setting} (no NPU: not applied)"
        if setting > 1:
            warn_at_user(
                f"npu_level={setting} needs torch_npu.npu.set_deterministic_level, which this "
                f"torch_npu lacks; it has {LEVEL_API_VERSIONS}. Falling back to level 1 "
                "(torch.use_deterministic_algorithms(True)).",
                DeterminismWarning,
            )
        if not torch.are_deterministic_algorithms_enabled():
            torch.use_deterministic_algorithms(True)
        asked = "" if setting == 1 else f", not {setting}"
        return f"npu_level=1 (algorithms on{asked}: this torch_npu has no levels)"

    def restore(self, saved: Any) -> None:
        if saved is None:
            return
        api = npu_level_api()
        if api is None:
            return
        now = int(_quietly(api[1]))
        # Levels 0 and 1 are torch's flag itself (torch_npu re-syncs the level with it),
        # which the algorithms switch restores next: only 2 and 3 need setting back.
        if now != saved and max(now, saved) >= 2:
            _quietly(api[0], saved)
