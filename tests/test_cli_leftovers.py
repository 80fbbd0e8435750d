"""What a command of ``detctx run`` starts goes when it goes: background jobs, daemons,
``setsid`` grandchildren.

Before: a background job holding the command's output made ``detctx run -n 2``
wait for it (60.7 s for ``sleep 30``; a daemon: for ever); with its output
redirected it was left running; a grandchild that called ``setsid`` survived
``kill -TERM`` of ``detctx run``. Each grandchild here lives two minutes unless
stopped, each ``detctx run`` gets a minute, and everything is killed in a
``finally``: the old behaviour fails the test in bounded time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli_hardening import alive

from detctx._cli.signals import RUNS_ENV, mark_run

GUARD_S = 60
"""How long one ``detctx run`` may take here; the new code needs a few seconds."""

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/environ").exists(), reason="finding a run's processes needs /proc"
)

# The command: starts a grandchild as MODE says (it appends its pid to PIDS and lives two
# minutes), prints a loss, then exits, or waits to be stopped ("setsid").
COMMAND = """
import os, sys, time
pids, mode = sys.argv[1], sys.argv[2]
def written():
    return open(pids).read().count("\\n") if os.path.exists(pids) else 0
before = written()
if os.fork() == 0:
    if mode in ("setsid", "daemon", "escaped"):
        os.setsid()
    if mode == "daemon" and os.fork():
        os._exit(0)
    if mode == "redirected":
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
    with open(pids, "a") as out:
        out.write(f"{os.getpid()}\\n")
    if mode == "escaped":  # no trace of the run left: another session, an empty environment
        os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)"], {})
    time.sleep(120)
    os._exit(0)
while written() == before:  # this run's grandchild has started
    time.sleep(0.01)
print("step 1 loss: 0.5", flush=True)
if mode == "setsid":
    time.sleep(120)
"""


@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[str]]]]:
    """The pid file the grandchildren write, and the ``detctx run`` processes; whatever of
    them is still there at the end is killed."""
    pids = tmp_path / "pids"
    runners: list[subprocess.Popen[str]] = []
    try:
        yield pids, runners
    finally:
        for runner in runners:
            if runner.poll() is None:
                os.killpg(runner.pid, signal.SIGKILL)
                runner.wait()
        for pid in grandchildren(pids):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def grandchildren(pids: Path) -> list[int]:
    return [int(line) for line in pids.read_text().split()] if pids.exists() else []


def detctx_run(tmp_path: Path, pids: Path, mode: str, runs: int) -> subprocess.Popen[str]:
    script = tmp_path / "command.py"
    script.write_text(textwrap.dedent(COMMAND))
    command = [sys.executable, str(script), str(pids), mode]
    return subprocess.Popen(
        [sys.executable, "-m", "detctx", "run", "-n", str(runs), "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that the fixture can kill all of it
    )


@pytest.mark.parametrize("mode", ["background", "redirected", "daemon"])
def test_what_a_command_leaves_running_is_stopped_when_it_exits(tmp_path, started, mode):
    pids, runners = started
    runner = detctx_run(tmp_path, pids, mode, runs=2)
    runners.append(runner)

    out, err = runner.communicate(timeout=GUARD_S)

    assert runner.returncode == 0, err
    assert "2 curves agree" in out
    left = grandchildren(pids)
    assert len(left) == 2
    assert not [pid for pid in left if alive(pid)]
    assert err.count("the command exited and left 1 process it started running") == 2


@pytest.mark.slow
def test_output_held_open_out_of_reach_is_read_for_a_bounded_time_and_said(tmp_path, started):
    pids, runners = started
    runner = detctx_run(tmp_path, pids, "escaped", runs=2)
    runners.append(runner)

    out, err = runner.communicate(timeout=GUARD_S)

    assert runner.returncode == 0, err
    assert "2 curves agree" in out
    assert err.count("still holds its output open, out of reach") == 2


def test_a_setsid_grandchild_goes_with_its_command_when_detctx_run_is_terminated(tmp_path, started):
    pids, runners = started
    runner = detctx_run(tmp_path, pids, "setsid", runs=2)
    runners.append(runner)
    deadline = time.monotonic() + GUARD_S
    while not grandchildren(pids):
        assert runner.poll() is None, runner.communicate()
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)

    runner.send_signal(signal.SIGTERM)
    _, err = runner.communicate(timeout=GUARD_S)

    assert runner.returncode == 128 + signal.SIGTERM, err
    (grandchild,) = grandchildren(pids)
    assert not alive(grandchild)


def test_each_run_is_marked_and_a_run_inside_a_run_keeps_the_outer_mark():
    env = {"PATH": "/bin"}

    outer = mark_run(env)
    inner = mark_run(env)

    assert outer != inner
    assert env[RUNS_ENV].split() == [outer, inner]
