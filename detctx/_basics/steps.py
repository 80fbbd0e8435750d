"""A recording's window of optimizer steps: ``"A:B"``, ``(A, B)`` or ``range(A, B)``.

Steps are counted as optimizer steps complete: step 0 runs until the first
``optimizer.step()`` of any optimizer returns, step 1 until the second, and so
on (two optimizers stepped once each count two). ``A:B`` records steps ``A``
to ``B - 1``, as a Python slice. Nothing here imports torch: ``detctx record``
checks its ``--steps`` before it starts the command.
"""

from __future__ import annotations

import re
from typing import Final

from detctx._basics.errors import TraceError

__all__ = ["STEPS_ENV", "parse_steps", "steps_text"]

STEPS_ENV: Final = "DETCTX_RECORD_STEPS"
"""How ``detctx record --steps`` tells the recording processes their window."""
_TEXT: Final = re.compile(r"([0-9]{1,12}):([0-9]{1,12})")
_USAGE: Final = (
    "a window of optimizer steps is 'A:B' (or (A, B), or range(A, B)) with 0 <= A < B: "
    "steps A to B - 1, counted as optimizer steps complete"
)


def parse_steps(value: object) -> tuple[int, int]:
    """``(A, B)`` from ``value``; :class:`~detctx.TraceError` for anything else."""
    if isinstance(value, str):
        match = _TEXT.fullmatch(value.strip())
        if match is None:
            raise TraceError(f"{_USAGE}; got {value[:40]!r}")
        start, end = int(match[1]), int(match[2])
    elif isinstance(value, range):
        if value.step != 1:
            raise TraceError(f"{_USAGE}; got {value!r} (a step other than 1)")
        start, end = value.start, value.stop
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        start, end = value
        if type(start) is not int or type(end) is not int:
            raise TraceError(f"{_USAGE}; got {value!r}")
    else:
        raise TraceError(f"{_USAGE}; got {type(value).__name__} {str(value)[:40]!r}")
    if not 0 <= start < end:
        raise TraceError(f"{_USAGE}; got {start}:{end}")
    return start, end


def steps_text(steps: tuple[int, int]) -> str:
    """The window as ``detctx record --steps`` and :data:`STEPS_ENV` write it."""
    return f"{steps[0]}:{steps[1]}"
