"""A recording that is killed leaves its detctx-locate-* folder; the next one removes it, and
nothing that is not provably a dead recording's."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import detctx
from detctx._basics import SCRATCH_LOCK, SCRATCH_PREFIX, scratch_folder, sweep_scratch
from detctx._cli.locate import Tracing

RECORDING = """
import os, signal, sys, torch, detctx
how = sys.argv[1]
def step():
    torch.ones(3).sin()
    print("recording", flush=True)
    if how == "SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "SIGTERM":
        os.kill(os.getpid(), signal.SIGTERM)
    if how == "os._exit":
        os._exit(3)
    sys.stdin.readline()  # "wait": until the test says go
detctx.locate_divergence(step)
"""

KILLED_CLI = """
import os, signal, pathlib
from detctx._cli.locate import Tracing
tracing = Tracing.start(None)
(tracing.folder / "run1.trace").write_bytes(b"a trace cut short")
print(tracing.folder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary directory of this test's own, for this process and its children."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def folders(where: Path) -> list[str]:
    return sorted(entry.name for entry in where.iterdir() if entry.name.startswith(SCRATCH_PREFIX))


def recording(how: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", RECORDING, how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "recording\n"
    return child


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "os._exit"])
def test_a_killed_recording_leaves_its_folder_and_the_next_recording_removes_it(
    how: str, scratch: Path
):
    child = recording(how)
    assert child.wait(timeout=60) != 0
    left = folders(scratch)
    assert len(left) == 1
    assert sorted(p.name for p in (scratch / left[0]).iterdir()) == [SCRATCH_LOCK, "run1.rows"]

    assert detctx.locate_divergence(lambda: torch.ones(2).sin()) is None

    assert folders(scratch) == []


@pytest.mark.slow
def test_the_folder_of_a_recording_still_running_is_left_alone(scratch: Path):
    child = recording("wait")
    try:
        alive = folders(scratch)
        assert len(alive) == 1

        assert detctx.locate_divergence(lambda: torch.ones(2).sin()) is None
        assert sweep_scratch() == []

        assert folders(scratch) == alive
    finally:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    assert folders(scratch) == []  # removed by its own recording


@pytest.mark.slow
def test_a_killed_detctx_run_locate_leaves_its_folder_and_the_next_one_removes_it(scratch: Path):
    done = subprocess.run(
        [sys.executable, "-c", KILLED_CLI], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -9, done.stderr
    left = Path(done.stdout.strip())
    assert left.is_dir() and any(left.glob("detctx-site-*/sitecustomize.py"))

    tracing = Tracing.start(None)
    try:
        assert not left.exists()
        assert folders(scratch) == [tracing.folder.name]
    finally:
        tracing.close()
    assert folders(scratch) == []


def dead_folder(where: Path, name: str) -> Path:
    """A folder as a killed recording leaves it: the lock file there, nobody holding it."""
    folder = where / name
    folder.mkdir()
    (folder / SCRATCH_LOCK).write_text("")
    (folder / "run1.rows").write_bytes(b"rows")
    return folder


def test_only_what_is_provably_a_dead_recordings_folder_is_removed(scratch: Path, tmp_path: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / SCRATCH_LOCK).write_text("")
    (outside / "precious.txt").write_text("keep me")
    dead = dead_folder(scratch, SCRATCH_PREFIX + "dead")
    no_lock = scratch / (SCRATCH_PREFIX + "nolock")
    no_lock.mkdir()
    (no_lock / "run1.rows").write_bytes(b"rows")
    extra = dead_folder(scratch, SCRATCH_PREFIX + "extra")
    (extra / "notes.txt").write_text("the user's")
    link_inside = dead_folder(scratch, SCRATCH_PREFIX + "linkinside")
    (link_inside / "run2.rows").symlink_to(outside / "precious.txt")
    lock_link = scratch / (SCRATCH_PREFIX + "locklink")
    lock_link.mkdir()
    (lock_link / SCRATCH_LOCK).symlink_to(outside / SCRATCH_LOCK)
    (scratch / (SCRATCH_PREFIX + "link")).symlink_to(outside)
    (scratch / (SCRATCH_PREFIX + "file")).write_text("not a folder")

    removed = sweep_scratch()

    assert removed == [dead.name]
    assert not dead.exists()
    assert folders(scratch) == sorted(
        SCRATCH_PREFIX + name
        for name in ("nolock", "extra", "linkinside", "locklink", "link", "file")
    )
    assert (outside / "precious.txt").read_text() == "keep me"
    assert (outside / SCRATCH_LOCK).exists() and (extra / "notes.txt").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_dead_looking_folder_of_another_user_is_left_alone(scratch: Path):
    theirs = dead_folder(scratch, SCRATCH_PREFIX + "theirs")
    for path in (theirs / SCRATCH_LOCK, theirs / "run1.rows", theirs):
        os.chown(path, 4242, 4242, follow_symlinks=False)

    assert sweep_scratch() == []
    assert theirs.exists()


def test_a_folder_in_use_in_this_process_is_left_alone_and_removed_when_closed(scratch: Path):
    mine = scratch_folder()
    try:
        (mine.path / "run1.rows").write_bytes(b"rows")
        assert sweep_scratch() == []
        assert mine.path.exists()
    finally:
        mine.close()
    assert folders(scratch) == []
