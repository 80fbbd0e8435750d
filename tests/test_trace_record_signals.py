"""``detctx record`` stopped by SIGTERM, SIGHUP or Ctrl-C stops its command and writes
nothing.

Before: SIGTERM or SIGHUP ended ``detctx record`` alone, leaving the command
running and recording and its staging folder beside ``-o``; Ctrl-C killed the
command but left the child it had started running.
The commands here live two minutes unless stopped, each wait is bounded, and
whatever is left is killed in a ``finally``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_cli_hardening import alive
from test_cli_leftovers import grandchildren, started  # noqa: F401 (a fixture)
from test_trace_record_cli import ENV

GUARD_S = 60
"""How long one ``detctx record`` may take to stop here; it needs a few seconds."""
START_S = 180
"""How long the command may take to import torch and start its child, on a busy machine."""

# Records an op, starts a child that sleeps, notes both pids, then sleeps itself.
TRAINING = """
import os, subprocess, sys, time
import torch
torch.ones(3).sum()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(sys.argv[1] + ".part", "w") as out:
    out.write(f"{os.getpid()}\\n{child.pid}\\n")
os.rename(sys.argv[1] + ".part", sys.argv[1])
time.sleep(120)
"""


def trace_bytes() -> bytes:
    return b"DETCTXST" + bytes(8)  # what detctx takes for a trace it recorded earlier


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum",
    [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
    ids=["TERM", "Ctrl-C", "HUP"],
)
def test_a_stopped_recording_stops_its_command_and_leaves_the_earlier_trace_alone(
    tmp_path: Path,
    started: tuple[Path, list[subprocess.Popen[str]]],  # noqa: F811 (the fixture imported)
    signum: int,
) -> None:
    pids, runners = started
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAINING))
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.trace").write_bytes(trace_bytes())
    runner = subprocess.Popen(
        [
            *(sys.executable, "-m", "detctx", "record", "-o", str(out / "a.trace"), "--"),
            *(sys.executable, str(script), str(pids)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,  # so that the signal reaches detctx record alone
    )
    runners.append(runner)
    deadline = time.monotonic() + START_S
    while not pids.exists():
        assert runner.poll() is None, runner.communicate()
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)

    runner.send_signal(signum)
    _, err = runner.communicate(timeout=GUARD_S)

    assert runner.returncode == 128 + signum, err
    assert f"nothing written to {out / 'a.trace'}" in err
    command, child = grandchildren(pids)
    assert not alive(command) and not alive(child)
    assert [path.name for path in out.iterdir()] == ["a.trace"]
    assert (out / "a.trace").read_bytes() == trace_bytes()
