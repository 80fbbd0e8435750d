"""Files that are not what they seem: ``/dev/zero`` or a FIFO as a log, a FIFO or a hard
link planted as ``--log-dir/run1.log``.

``detctx compare /dev/zero x`` read until memory ran out and exited 1 ("differ")
with a traceback; a FIFO as a log, or planted as a run log, blocked for ever; a
hard link planted as a run log had the file behind it overwritten. Each child
here runs under a memory limit and a time limit, so the old behaviour fails the
test instead of the machine.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from detctx import MetricsError
from detctx import _cli as cli
from detctx._cli import paths

GUARD_S = 60
"""A child's time limit; the refusals take well under a second."""

MEMORY_LIMIT = 2 << 30
"""A child's address space: enough for Python and the CLI, far from enough for /dev/zero."""

COMMAND = "import pathlib, sys; pathlib.Path(sys.argv[1]).touch(); print('step 1 loss: 0.5')"

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and rlimits")


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def detctx_in_a_child(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "detctx", *args],
        capture_output=True,
        text=True,
        timeout=GUARD_S,
        preexec_fn=limited,
    )


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "run.log"
    path.write_text("step 1 loss: 0.5\nstep 2 loss: 0.25\n")
    return path


def test_compare_with_dev_zero_is_refused_at_once_with_status_2(log: Path):
    done = detctx_in_a_child("compare", "/dev/zero", str(log))

    assert done.returncode == 2, done.stderr
    assert "cannot read /dev/zero: it is a character device" in done.stderr
    assert "Traceback" not in done.stderr


def test_compare_with_a_fifo_nobody_writes_is_refused_instead_of_waiting(tmp_path: Path, log: Path):
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)

    done = detctx_in_a_child("compare", str(log), str(fifo))

    assert done.returncode == 2, done.stderr
    assert f"cannot read {fifo}: it is a FIFO (named pipe)" in done.stderr


@pytest.mark.parametrize("name", ["huge.log", "metrics.csv", "trainer_state.json"])
def test_compare_of_a_log_larger_than_the_bound_is_refused_before_it_is_read(
    tmp_path: Path, log: Path, name: str
):
    huge = tmp_path / name
    with open(huge, "wb") as file:
        file.truncate(paths.MAX_LOG_BYTES + 1)  # sparse: no disk, and reading it takes seconds

    done = detctx_in_a_child("compare", str(huge), str(log))

    assert done.returncode == 2, done.stderr
    assert f"cannot read {huge}: it is larger than 1,073,741,824 bytes" in done.stderr


def test_no_more_than_the_bound_is_read_from_a_log(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(paths, "MAX_LOG_BYTES", 40)
    short = tmp_path / "short.log"
    short.write_text("step 1 loss: 0.5\nstep 2 loss: 0.25\n")  # 34 bytes
    longer = tmp_path / "longer.log"
    longer.write_text("step 1 loss: 0.5\nstep 2 loss: 0.25\nstep 3 loss: 0.125\n")

    assert cli.main(["compare", str(short), str(short)]) == 0
    assert cli.main(["compare", str(short), str(longer)]) == 2
    assert "larger than 40 bytes" in capsys.readouterr().err


def test_a_fifo_planted_as_a_run_log_is_refused_before_anything_runs(tmp_path: Path):
    logs = tmp_path / "logs"
    logs.mkdir()
    os.mkfifo(logs / "run1.log")
    ran = tmp_path / "ran"

    done = detctx_in_a_child(
        "run", "--log-dir", str(logs), "--", sys.executable, "-c", COMMAND, str(ran)
    )

    assert done.returncode == 2, done.stderr
    assert f"refusing to write {logs / 'run1.log'}: it is a FIFO" in done.stderr
    assert not ran.exists()
    assert (logs / "run1.log").is_fifo()


@pytest.mark.parametrize("planted", ["run1.log", "run2.log"])
def test_a_hard_link_planted_as_a_run_log_is_refused_and_its_file_kept(
    tmp_path: Path, planted: str, capsys
):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    logs = tmp_path / "logs"
    logs.mkdir()
    os.link(precious, logs / planted)
    ran = tmp_path / "ran"

    status = cli.main(
        ["run", "--log-dir", str(logs), "--", sys.executable, "-c", COMMAND, str(ran)]
    )

    assert status == 2
    assert f"refusing to write {logs / planted}: it is a hard link" in capsys.readouterr().err
    assert precious.read_text() == "keep me"
    assert not ran.exists()


def test_a_run_log_left_by_an_earlier_run_is_overwritten(tmp_path: Path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "run1.log").write_text("an earlier run's output, longer than this one's\n")

    with paths.open_for_writing(logs / "run1.log") as out:
        out.write("step 1 loss: 0.5\n")

    assert (logs / "run1.log").read_text() == "step 1 loss: 0.5\n"


@pytest.mark.parametrize("kind", ["hard link", "FIFO"])
def test_something_planted_between_the_check_and_the_open_is_not_written_into(
    tmp_path: Path, monkeypatch, kind: str
):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    target = tmp_path / "run1.log"

    def plant_after_the_check(path: Path) -> None:
        if kind == "hard link":
            os.link(precious, path)
        else:
            os.mkfifo(path)

    monkeypatch.setattr(paths, "refuse_planted", plant_after_the_check)

    with pytest.raises(MetricsError, match=f"refusing to write {target}: it is a {kind}"):
        paths.open_for_writing(target)
    assert precious.read_text() == "keep me"


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's /proc")
def test_a_file_that_reports_a_smaller_size_than_it_holds_is_still_read_bounded(monkeypatch):
    # /proc's files report size 0, as a file still being written can report less than it holds.
    monkeypatch.setattr(paths, "MAX_LOG_BYTES", 40)

    with pytest.raises(MetricsError, match="larger than 40 bytes"):
        paths.read_log_text(Path("/proc/self/status"))
