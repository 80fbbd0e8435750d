"""Files ``detctx run`` writes into a folder it shares with others: ``--log-dir``.

A folder the user names may hold links someone else planted. Opening
``DIR/run1.log`` for writing followed a symbolic link there and overwrote
the file it pointed to, outside the folder; the ``--locate`` shim folder
``DIR/detctx-site``, when it was a link, had the shim written through it
and was deleted afterwards. So here nothing is followed that detctx did not
create, and nothing is deleted that it did not create: a link where detctx
means to write is refused, naming it, before the first run starts.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO, Final

from detctx._basics import MetricsError

__all__ = ["open_for_writing", "refuse_link", "remove_created"]

_NO_FOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)


def refuse_link(path: Path) -> None:
    """Raise :class:`~detctx.MetricsError` if ``path`` is a symbolic link."""
    if path.is_symlink():
        try:
            target = f" (to {os.readlink(path)})"
        except OSError:
            target = ""
        raise MetricsError(
            f"refusing to write {path}: it is a symbolic link{target} that detctx did not "
            "create, and detctx neither follows nor removes it; remove it yourself or choose "
            "another --log-dir"
        )


def open_for_writing(path: Path) -> IO[str]:
    """``open(path, "w")``, except that a symbolic link at ``path`` is refused, not followed."""
    refuse_link(path)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NO_FOLLOW, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # planted between the check and the open
            refuse_link(path)
        raise
    return open(descriptor, "w", encoding="utf-8")


def remove_created(folder: Path, files: list[str]) -> list[str]:
    """Remove ``files`` (names in ``folder``, links included, never followed), then
    ``folder`` if it is empty; return what was left there."""
    for name in files:
        try:
            (folder / name).unlink()
        except FileNotFoundError:
            pass
    try:
        os.rmdir(folder)
    except FileNotFoundError:
        return []
    except OSError:
        return sorted(entry.name for entry in folder.iterdir())
    return []
