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
"""

from __future__ import annotations

import sys
from typing import Any, Final

from detctx._environment import getenv, setenv

__all__ = ["VARIABLE", "capture", "restore", "switch_on"]

VARIABLE: Final = "TORCHINDUCTOR_DETERMINISTIC"
"""Inductor's default for ``deterministic`` (exactly ``"1"`` is on), read at its import."""

_CONFIG: Final = "torch._inductor.config"


def capture() -> tuple[str | None, bool | None]:
    """The variable's value, and inductor's setting (``None`` while it is not imported)."""
    config: Any = sys.modules.get(_CONFIG)
    return getenv(VARIABLE), None if config is None else bool(config.deterministic)


def switch_on(current: tuple[str | None, bool | None]) -> None:
    """Make inductor compile deterministically, now or when it is imported.

    ``current`` is what :func:`capture` returned just before.
    """
    config: Any = sys.modules.get(_CONFIG)
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
    config: Any = sys.modules.get(_CONFIG)
    if config is not None:
        # Written without reading it first: a config read costs as much as a write (about
        # 2 us), and a decorated generator's world swap restores this twice a step.
        config.deterministic = variable == "1" if deterministic is None else deterministic
