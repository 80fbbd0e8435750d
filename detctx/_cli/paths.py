"""Files detctx writes into a folder it shares with others (``--log-dir``), and logs it reads.

A folder the user names may hold links someone else planted. Opening
``DIR/run1.log`` for writing followed a symbolic link there and overwrote
the file it pointed to, outside the folder; a hard link there had the file
behind its other name overwritten, and a FIFO blocked the run for ever. The
``--locate`` shim folder ``DIR/detctx-site``, when it was a link, had the
shim written through it and was deleted afterwards. So here nothing is
followed that detctx did not create, and nothing is deleted that it did not
create: a link, or anything but a regular file of one name, where detctx
means to write is refused, naming it, before the first run starts.

A log ``detctx compare`` reads is untrusted too: ``detctx compare /dev/zero
x`` read until memory ran out, and a FIFO blocks its reader until someone
writes. So a log is read only if it is a regular file of at most
:data:`MAX_LOG_BYTES`, and never more than that many bytes are read.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO, Final

from detctx._basics import MetricsError

__all__ = [
    "MAX_LOG_BYTES",
    "open_for_writing",
    "read_log_text",
    "refuse_link",
    "refuse_planted",
    "remove_created",
]

_NO_FOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
# Opening a FIFO to read waits for a writer unless non-blocking (fstat then refuses it).
_NO_WAIT: Final = getattr(os, "O_NONBLOCK", 0)

MAX_LOG_BYTES: Final = 1 << 30
"""The largest log ``detctx compare`` reads (1 GiB): its text, and the lines split from it,
are held in memory at once (about three times the file's size)."""

_KINDS: Final = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


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


def refuse_planted(path: Path) -> None:
    """Raise :class:`~detctx.MetricsError` if ``path`` holds something detctx must not write
    into: a symbolic link, anything but a regular file, or a file with other names.

    A FIFO planted as ``run1.log`` blocked ``detctx run`` for ever on opening it,
    and a hard link had the file behind its other name truncated and overwritten.
    """
    refuse_link(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    _refuse_kind(path, info)


def _refuse_planted_now(path: Path) -> None:
    """:func:`refuse_planted` once more, after an open found something planted since."""
    refuse_link(path)
    _refuse_kind(path, os.lstat(path))


def _refuse_kind(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
        raise MetricsError(
            f"refusing to write {path}: it is {kind}, which detctx did not create and does "
            "not write into; remove it yourself or choose another --log-dir"
        )
    if info.st_nlink > 1:
        raise MetricsError(
            f"refusing to write {path}: it is a hard link (one file with {info.st_nlink} "
            "names), and writing it would overwrite the file behind its other names; remove "
            "it yourself or choose another --log-dir"
        )


def open_for_writing(path: Path) -> IO[str]:
    """``open(path, "w")``, except that what :func:`refuse_planted` refuses is refused, not
    written into, even when it is planted between that check and the open."""
    refuse_planted(path)
    try:
        # Not O_TRUNC: the file is checked first, truncated once it is known to be ours.
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | _NO_FOLLOW | _NO_WAIT, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link, a FIFO without a reader
            _refuse_planted_now(path)
        raise
    try:
        _refuse_kind(path, os.fstat(descriptor))
        os.ftruncate(descriptor, 0)
    except BaseException:
        os.close(descriptor)
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


def read_log_text(path: Path, encoding: str = "utf-8") -> str:
    """The text of the log file at ``path``, undecodable bytes replaced.

    Raises :class:`~detctx.MetricsError` for a missing or unreadable file,
    for anything but a regular file (a device such as ``/dev/zero`` never
    ends, a FIFO waits for a writer), and for a file larger than
    :data:`MAX_LOG_BYTES`, or one that grew past it while it was read.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | _NO_WAIT)
    except FileNotFoundError:
        raise MetricsError(f"no such log file: {path}") from None
    except OSError as exc:
        raise MetricsError(f"cannot read {path}: {exc.strerror or exc}") from None
    too_large = MetricsError(
        f"cannot read {path}: it is larger than {MAX_LOG_BYTES:,} bytes, the most detctx "
        f"reads; keep the metric lines only (e.g. grep -i loss {path} > loss.log)"
    )
    with open(descriptor, "rb") as file:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
            raise MetricsError(
                f"cannot read {path}: it is {kind}, and detctx reads logs from regular files "
                "only; save the output to a file first"
            )
        if info.st_size > MAX_LOG_BYTES:
            raise too_large
        try:
            # Bounded as well: a file may grow while it is read, and /proc's report size 0.
            data = file.read(MAX_LOG_BYTES + 1)
        except OSError as exc:
            raise MetricsError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_LOG_BYTES:
        raise too_large
    return data.decode(encoding, errors="replace")
