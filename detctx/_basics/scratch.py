"""The scratch folders of a recording (``detctx-locate-XXXXXXXX``), and the removal of those
whose process has ended.

``locate_divergence`` and ``detctx run --locate`` keep their rows or traces
in a folder of the temporary directory and remove it when they end. A
process that is killed (SIGKILL, SIGTERM's default action) or leaves
through ``os._exit`` removes nothing, and its folder stayed for ever. So
the folder holds ``detctx-owner.lock``, locked (``flock``) by the process
for as long as the folder is in use: the kernel lets go of the lock when
the process ends, however it ends. Each new folder is made after a sweep
that removes a ``detctx-locate-*`` folder only when every one of these
holds:

* it is a folder, not a link, owned by this user;
* it holds the lock file, a regular file of one name owned by this user,
  and the lock can be taken: no process holds it, so its owner has ended
  (a process that got the dead owner's pid does not hold it; a live owner
  in another run, another pid namespace or another container sharing the
  folder does);
* it holds nothing but what a recording writes there (:data:`ENTRIES`).

Anything else is left as it is, and nothing is followed: the folder is
opened with ``O_NOFOLLOW`` and removed from a descriptor of the temporary
directory (``shutil.rmtree`` with ``dir_fd`` unlinks a link inside, never
what it points to). The lock file is made under another name, locked, and
only then renamed into place, so a sweep never finds the lock of a live
folder free. Where ``flock`` does not exist (Windows), nothing is swept.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Final

__all__ = [
    "ENTRIES",
    "SCRATCH_LOCK",
    "SCRATCH_PREFIX",
    "Scratch",
    "scratch_folder",
    "sweep_scratch",
]

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

SCRATCH_PREFIX: Final = "detctx-locate-"
SCRATCH_LOCK: Final = "detctx-owner.lock"
ENTRIES: Final = re.compile(r"run\d{1,9}\.(?:rows|trace)")
"""The files a recording writes into its folder, besides the lock and the shim's folder."""
_SITE: Final = re.compile(r"detctx-site-\w{8}")
_BYTECODE: Final = re.compile(r"sitecustomize\.[\w.-]+\.pyc")
_NEW_LOCK: Final = ".detctx-owner.new"
_NO_FOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY: Final = getattr(os, "O_DIRECTORY", 0)


class Scratch:
    """A scratch folder (``path``) and the lock that says its process is alive."""

    def __init__(self, path: Path, lock: int | None) -> None:
        self.path = path
        self._lock = lock

    def close(self) -> None:
        """Remove the folder, then let go of the lock (a second call does nothing)."""
        lock, self._lock = self._lock, None
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            if lock is not None:
                os.close(lock)


def scratch_folder() -> Scratch:
    """Sweep the folders of ended recordings, then make a new one, locked."""
    sweep_scratch()
    path = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
    if fcntl is None:
        return Scratch(path, None)
    descriptor = os.open(path / _NEW_LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(descriptor, b"detctx: this folder is in use while this file is locked\n")
        os.rename(path / _NEW_LOCK, path / SCRATCH_LOCK)
    except BaseException:
        os.close(descriptor)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return Scratch(path, descriptor)


def sweep_scratch(where: Path | None = None) -> list[str]:
    """Remove the scratch folders in ``where`` (the temporary directory) whose process has
    ended; their names. Never raises for what it finds there."""
    if fcntl is None:
        return []
    folder = str(where) if where is not None else tempfile.gettempdir()
    removed = []
    try:
        parent = os.open(folder, os.O_RDONLY | _DIRECTORY)
    except OSError:
        return []
    try:
        with os.scandir(parent) as entries:
            names = [entry.name for entry in entries if entry.name.startswith(SCRATCH_PREFIX)]
        for name in names:
            try:
                if _remove_if_ended(parent, name):
                    removed.append(name)
            except OSError:
                continue  # gone meanwhile, or not ours to read: left as it is
    finally:
        os.close(parent)
    return removed


def _remove_if_ended(parent: int, name: str) -> bool:
    assert fcntl is not None
    me = os.geteuid()
    info = os.lstat(name, dir_fd=parent)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != me:
        return False
    folder = os.open(name, os.O_RDONLY | _DIRECTORY | _NO_FOLLOW, dir_fd=parent)
    try:
        if not _only_ours(folder, me):
            return False
        lock = os.open(SCRATCH_LOCK, os.O_RDONLY | _NO_FOLLOW, dir_fd=folder)
    finally:
        os.close(folder)
    try:
        held = os.fstat(lock)
        if not stat.S_ISREG(held.st_mode) or held.st_uid != me or held.st_nlink != 1:
            return False
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its process is alive
        # Held until the folder is gone: a second sweep waits on nothing and skips it.
        shutil.rmtree(name, dir_fd=parent, ignore_errors=True)
        return True
    finally:
        os.close(lock)


def _only_ours(folder: int, me: int) -> bool:
    """Whether the folder holds the lock and nothing a recording does not write there."""
    found_lock = False
    with os.scandir(folder) as entries:
        for entry in entries:
            info = entry.stat(follow_symlinks=False)
            if info.st_uid != me:
                return False
            if entry.name == SCRATCH_LOCK:
                found_lock = stat.S_ISREG(info.st_mode)
            elif _SITE.fullmatch(entry.name) and stat.S_ISDIR(info.st_mode):
                if not _only_the_shim(folder, entry.name):
                    return False
            elif not (ENTRIES.fullmatch(entry.name) and stat.S_ISREG(info.st_mode)):
                return False
    return found_lock


def _only_the_shim(folder: int, name: str) -> bool:
    """Whether the shim's folder holds the shim and its bytecode only."""
    site = _listing(folder, name)
    for entry, kind in site.items():
        if entry == "__pycache__" and kind == "folder":
            cache = _listing(folder, f"{name}/__pycache__")
            if any(
                not (_BYTECODE.fullmatch(item) and is_file == "file")
                for item, is_file in cache.items()
            ):
                return False
        elif not (entry == "sitecustomize.py" and kind == "file"):
            return False
    return True


def _listing(folder: int, name: str) -> dict[str, str]:
    """The entries of the folder ``name`` (below ``folder``, no link followed on the way):
    ``"file"``, ``"folder"`` or ``"other"`` each."""
    inner = folder
    opened = []
    try:
        for part in name.split("/"):
            inner = os.open(part, os.O_RDONLY | _DIRECTORY | _NO_FOLLOW, dir_fd=inner)
            opened.append(inner)
        with os.scandir(inner) as entries:
            return {
                entry.name: "file"
                if entry.is_file(follow_symlinks=False)
                else "folder"
                if entry.is_dir(follow_symlinks=False)
                else "other"
                for entry in entries
            }
    finally:
        for descriptor in opened:
            os.close(descriptor)
