"""``detctx record`` stopped by SIGTERM, SIGHUP or Ctrl-C stops its command and writes
nothing; the recording's variables stay out of the processes that do not record.

Before: SIGTERM or SIGHUP ended ``detctx record`` alone, leaving the command
running and recording and its staging folder beside ``-o``; Ctrl-C killed the
command but left the child it had started running; and every process the command started
inherited ``$DETCTX_RECORD_DIR`` and the shim, and imported torch through it.
The commands here live two minutes unless stopped, each wait is bounded, and
whatever is left is killed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_cli_hardening import alive
from test_cli_leftovers import grandchildren, started  # noqa: F401 (a fixture)
from test_trace_record_cli import ENV, detctx

from detctx._cli.record import RECORD_ENV, RUN_ENV
from detctx._cli.record_child import forget_recording, is_torch_launcher
from detctx._compare.reading import read_trace

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

# What a process sees of the recording, as one JSON line; run as a script, it starts
# itself again for each further name (a child, a grandchild).
SEEN = """
import json, os, subprocess, sys

def show(who):
    print(json.dumps({"who": who, "rank": os.environ.get("RANK"),
                      "dir": os.environ.get("DETCTX_RECORD_DIR"),
                      "pythonpath": os.environ.get("PYTHONPATH"),
                      "run": os.environ.get("DETCTX_RECORD_RUN"),
                      "torch": "torch" in sys.modules}), flush=True)

if __name__ == "__main__":
    show(sys.argv[1])
    if len(sys.argv) > 2:
        subprocess.run([sys.executable, __file__, *sys.argv[2:]], check=True)
"""

# The recorded program: runs an op, shows what it sees, starts a child.
RECORDED = """
import os, subprocess, sys
import torch
torch.ones(3).sum()
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from seen import show
show("process")
subprocess.run([sys.executable, sys.argv[1], "child", "grandchild"], check=True)
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


def seen(stdout: str) -> dict[str, dict[str, object]]:
    """The JSON objects the processes printed. Two ranks print at once into one pipe, so
    one line may hold both objects, one after the other."""
    decoder, found = json.JSONDecoder(), []
    for line in stdout.splitlines():
        at = line.find("{")
        while at >= 0:
            view, end = decoder.raw_decode(line, at)
            found.append(view)
            at = line.find("{", end)
    return {f"{view['who']}{view['rank'] or ''}": view for view in found}


def assert_left_out(views: dict[str, dict[str, object]]) -> None:
    """Every process sees no recording folder, no run id and only the test's PYTHONPATH;
    what the recorded process starts has not imported torch."""
    for who, view in views.items():
        assert (view["dir"], view["run"], view["pythonpath"]) == (None, None, str(ROOT)), who
        assert who.startswith("process") or not view["torch"], who


@pytest.mark.slow
def test_what_a_recorded_program_starts_neither_sees_the_recording_nor_loads_torch(
    tmp_path: Path,
) -> None:
    (tmp_path / "seen.py").write_text(textwrap.dedent(SEEN))
    (tmp_path / "train.py").write_text(textwrap.dedent(RECORDED))

    script, seen_py = str(tmp_path / "train.py"), str(tmp_path / "seen.py")
    done = detctx("record", "-o", str(tmp_path / "a.trace"), "--", sys.executable, script, seen_py)

    assert done.returncode == 0, done.stderr
    views = seen(done.stdout)
    assert sorted(views) == ["child", "grandchild", "process"]
    assert_left_out(views)
    assert re.fullmatch("[0-9a-f]{32}", read_trace(tmp_path / "a.trace").run)
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_under_torchrun_the_ranks_record_one_run_and_what_they_start_does_not(
    tmp_path: Path,
) -> None:
    (tmp_path / "seen.py").write_text(textwrap.dedent(SEEN))
    (tmp_path / "rank.py").write_text(textwrap.dedent(RECORDED))
    rank, seen_py = str(tmp_path / "rank.py"), str(tmp_path / "seen.py")
    done = detctx(
        *("record", "-o", str(tmp_path / "run"), "--", sys.executable, "-m"),
        *("torch.distributed.run", "--standalone", "--nproc-per-node", "2", rank, seen_py),
    )

    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["rank0.trace", "rank1.trace"]
    views = seen(done.stdout)
    assert sorted(views) == [
        f"{who}{rank}" for who in ("child", "grandchild", "process") for rank in (0, 1)
    ]
    assert_left_out(views)
    (run,) = {read_trace(tmp_path / "run" / f"rank{rank}.trace").run for rank in (0, 1)}
    assert re.fullmatch("[0-9a-f]{32}", run)  # the id detctx record drew, in both ranks


def test_torchs_launcher_is_told_from_a_program_by_its_command_line() -> None:
    python = sys.executable
    assert is_torch_launcher([python, "-m", "torch.distributed.run", "--standalone", "t.py"])
    assert is_torch_launcher([python, "-u", "-X", "dev", "-mtorch.distributed.launch", "t.py"])
    assert is_torch_launcher([python, "/venv/bin/torchrun", "--nproc-per-node", "2", "t.py"])
    assert not is_torch_launcher([python, "train.py", "torchrun"])
    assert not is_torch_launcher([python, "-c", "import torchrun", "-m", "torchrun"])
    assert not is_torch_launcher([python, "-u", "-m", "train", "--launcher", "torchrun"])
    assert not is_torch_launcher([python])


def test_forgetting_the_recording_keeps_the_rest_of_pythonpath() -> None:
    env = {
        RECORD_ENV: "/tmp/.a.trace.recording-x",
        RUN_ENV: "ab" * 16,
        "PYTHONPATH": os.pathsep.join(["/tmp/.a.trace.recording-x/site", "/src", "/lib"]),
    }
    forget_recording(env)
    assert env == {"PYTHONPATH": os.pathsep.join(["/src", "/lib"])}

    alone = {RECORD_ENV: "/r", "PYTHONPATH": os.path.join("/r", "site")}
    forget_recording(alone)
    assert alone == {}
