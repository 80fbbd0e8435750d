"""Warnings that point at the user's line.

A fixed ``stacklevel`` is right for one call path only: the cuBLAS warning
of ``with detctx.deterministic(...)`` is five frames below the ``with`` line
on entry, a different number through a decorator, ``seed_all`` or a
distributed block. :func:`warn_at_user` counts the frames instead: it attributes
the warning to the first frame outside detctx (and outside ``contextlib``,
whose ``ExitStack.enter_context`` and ``@contextmanager`` wrappers stand
between a user's line and a block, and outside the framework whose callback
raised it), so ``-W error`` tracebacks, the ``warnings`` filters by module and
pytest's report all name the user's file and line::

    python -W always -c "import detctx; detctx.Run"   # <string>:1: DeprecationWarning: ...
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["warn_at_user"]

# Frames of these modules stand between a user's line and detctx: ExitStack.enter_context
# and @contextmanager wrappers.
_PASSED: tuple[str, ...] = ("detctx", "contextlib")


def warn_at_user(
    message: str, category: type[Warning], *, through: tuple[str, ...] = ()
) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line.

    ``through`` names more packages to look past, for a warning raised in a
    framework's callback (``("lightning", "torch")``): the user's line is
    then the ``trainer.fit(...)`` that led there.
    """
    passed = _PASSED + through
    frame = sys._getframe(1)
    level = 2  # the caller of this function
    while frame.f_back is not None and _inside(frame.f_globals.get("__name__", ""), passed):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


def _inside(module: object, packages: tuple[str, ...]) -> bool:
    if not isinstance(module, str):
        return False
    return any(module == package or module.startswith(package + ".") for package in packages)
