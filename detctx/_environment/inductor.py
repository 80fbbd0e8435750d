"""torch._inductor's ``deterministic`` setting, followed without importing inductor.

``torch.use_deterministic_algorithms(mode)`` also sets
``torch._inductor.config.deterministic = mode`` (what ``torch.compile``
reads), importing inductor, and most of dynamo with it, to do so: about 1 s
the first time in a process on torch 2.13 (see it with
``python -X importtime -c "import torch; torch.use_deterministic_algorithms(True)"``).
The algorithms switch keeps that coupling without the import: it sets the
value directly when inductor is already imported; otherwise it sets
``TORCHINDUCTOR_DETERMINISTIC=1``, which inductor reads as its default when
it is imported, so an import inside a block sees the block's value.

Older torch (2.1 to 2.5) has no such setting: its inductor config raises
``AttributeError`` for ``deterministic`` (``python -c "import
torch._inductor.config as c; c.deterministic"`` on torch 2.1.2), so there the
config is left alone and only the variable, which nothing reads, follows the block.
"""

from __future__ import annotations

import sys
from typing import Any, Final

from detctx._basics import process_cache
from detctx._environment.variables import getenv, setenv

__all__ = ["VARIABLE", "capture", "restore", "switch_on"]

VARIABLE: Final = "TORCHINDUCTOR_DETERMINISTIC"
"""Inductor's default for ``deterministic`` (exactly ``"1"`` is on), read at its import."""

_CONFIG: Final = "torch._inductor.config"
_has_setting: tuple[object, bool] | None = None


@process_cache
def _forget_setting() -> None:
    global _has_setting
    _has_setting = None


def _config() -> Any:
    """Inductor's config module, if it is imported and has the ``deterministic`` setting."""
    global _has_setting
    config = sys.modules.get(_CONFIG)
    if config is None:
        return None
    if _has_setting is None or _has_setting[0] is not config:
        _has_setting = (config, hasattr(config, "deterministic"))
    return config if _has_setting[1] else None


def capture() -> tuple[str | None, bool | None]:
    """The variable's value, and inductor's setting (``None`` while it is not imported)."""
    config = _config()
    return getenv(VARIABLE), None if config is None else bool(config.deterministic)


def switch_on(current: tuple[str | None, bool | None]) -> None:
    """Make inductor compile deterministically, now or when it is imported.

    ``current`` is what :func:`capture` returned just before.
    """
    config = _config()
    if config is None:
        if current[0] != "1":
            setenv(VARIABLE, "1")
    elif current[1] is not True:
        config.deterministic = True


def restore(saved: tuple[str | None, bool | None]) -> None:
    """Put back what :func:`capture` saw. Inductor imported since then gets the value
    that import would have read at the capture."""
    variable, deterministic = saved
    if getenv(VARIABLE) != variable:
        setenv(VARIABLE, variable)
    config = _config()
    if config is not None:
        # Written without reading it first: a config read costs as much as a write (about
        # 2 us), and a decorated generator's world swap restores this twice a step.
        config.deterministic = variable == "1" if deterministic is None else deterministic
