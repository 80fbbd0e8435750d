"""A recording's ``portable_random`` option: the seed its random ops draw from, checked.

``None`` or ``False``: off, random ops draw from torch's generators. ``True``:
keyed by ``torch.initial_seed()`` as the recording starts (read by the
caller: nothing here imports torch). An integer in ``[0, 2**64)``: that
seed. ``detctx record --portable-random [SEED]`` checks its value before the
command starts and hands it to the recording processes in
:data:`PORTABLE_ENV`, as :func:`portable_text` writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from detctx._basics.errors import TraceError
from detctx._basics.seeds import as_integer, parse_seed

__all__ = ["MAX_PORTABLE_SEED", "PORTABLE_ENV", "parse_portable", "portable_seed", "portable_text"]

PORTABLE_ENV: Final = "DETCTX_RECORD_PORTABLE_RANDOM"
"""How ``detctx record --portable-random`` tells the recording processes their seed."""
MAX_PORTABLE_SEED: Final = 2**64 - 1
_INITIAL: Final = "initial"
"""The text of ``True``: ``torch.initial_seed()`` when the recording starts."""
_USAGE: Final = (
    "portable_random is None or False (off), True (keyed by torch.initial_seed() when the "
    "recording starts) or an integer seed in [0, 2**64 - 1]"
)


def portable_seed(value: object, initial_seed: Callable[[], int]) -> int | None:
    """The seed random ops draw from under ``portable_random=value`` (``initial_seed()`` for
    ``True``), ``None`` when off; :class:`~detctx.TraceError` for anything else (a float, a
    negative number, a str)."""
    if value is None or value is False:
        return None
    if value is True:
        return int(initial_seed()) & MAX_PORTABLE_SEED
    number = as_integer(value)
    if number is None or not 0 <= number <= MAX_PORTABLE_SEED:
        shown = f"{type(value).__name__} {str(value)[:40]!r}"
        raise TraceError(f"{_USAGE}; got {shown}")
    return number


def parse_portable(text: str, what: str = f"${PORTABLE_ENV}") -> int | bool:
    """The setting written in ``text``: ``initial`` (``True``) or a seed in decimal digits;
    :class:`~detctx.TraceError` naming ``what`` for anything else."""
    if text.strip() == _INITIAL:
        return True
    try:
        return parse_seed(text, what, maximum=MAX_PORTABLE_SEED)
    except ValueError as exc:
        raise TraceError(f"{exc}, or {_INITIAL!r} for torch.initial_seed()") from None


def portable_text(setting: int | bool) -> str:
    """The setting as :data:`PORTABLE_ENV` carries it: ``initial`` for ``True``, else the
    seed."""
    return _INITIAL if setting is True else str(int(setting))
