"""detctx's own torch work, kept out of the program's recordings.

The ranks' agreements (one ``all_gather`` of seeds, fingerprints or a resume's
verdict) run torch ops and collectives inside the program, and what they
gather can differ from launch to launch (a run's identity): a recording that
kept them would not be the program's, and two recordings of one program
would differ there. Code that runs such work wraps it in :func:`own_work`;
a recording skips every op issued meanwhile (on this thread).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["doing_own_work", "own_work"]


class _Depth(threading.local):
    value = 0


_depth = _Depth()


@contextlib.contextmanager
def own_work() -> Iterator[None]:
    """Mark the torch ops run inside as detctx's own, not the program's."""
    _depth.value += 1
    try:
        yield
    finally:
        _depth.value -= 1


def doing_own_work() -> bool:
    """Whether detctx's own work runs on this thread now."""
    return _depth.value > 0
