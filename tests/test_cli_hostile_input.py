"""``detctx`` against hostile input: backtracking lines, wide CSVs, planted links, Ctrl-C.

Where the attack is a time (a line that took minutes), the test feeds a line
far longer than the one that took minutes and runs it in a child with a
generous timeout: the old code would need days, the new one needs about a
second. Times themselves are in benchmarks/hammer_patterns.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_cli import detctx_command

from detctx import _cli as cli
from detctx._cli.curves import DEFAULT_PATTERN, METRIC_VALUE, PATTERN_REACH

GUARD_S = 120
"""A child's time limit: about 100 times what the linear code needs on a loaded machine."""


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def compare_in_a_child(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "detctx", "compare", *args],
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )


# The default pattern as it was: the same language, read in quadratic time.
OLD_DEFAULT = r"(?i)(?<![\w.-])(?:(?:lm|train)[ _])?loss['\"]?\s*[:=]?\s*" + METRIC_VALUE


PIECES = ["loss", "Loss", " ", "\t", ":", "=", "'", "0.5", "1e-3", "x", "lm ", "tensor("]


@given(st.lists(st.sampled_from(PIECES), max_size=12).map("".join))
def test_the_default_pattern_reads_what_it_read_before(line: str) -> None:
    old, new = re.search(OLD_DEFAULT, line), re.search(DEFAULT_PATTERN, line)

    assert (old and (old.span(), old.group("value"))) == (new and (new.span(), new.group("value")))


@pytest.mark.parametrize(
    "line",
    [
        "loss" + " " * 1_000_000,  # 8,000 spaces took 7.7 s through compare, 32,000 took 127.6 s
        "loss: 0.5 step" + " " * 1_000_000,  # the step pattern, read once a loss is found
        "LOSS =" + " " * 1_000_000 + "tensor(" + " " * 1_000_000,
    ],
    ids=["loss", "step", "tensor"],
)
def test_a_line_that_made_the_default_patterns_backtrack_is_read_in_seconds(
    tmp_path: Path, line: str
) -> None:
    log = write(tmp_path / "a.log", f"{line}\nstep 1 loss: 0.25\n")

    done = compare_in_a_child(str(log), str(log))

    assert done.returncode == 0, done.stderr
    assert "agree" in done.stdout


def test_detctx_run_reads_such_a_line_from_a_command_in_seconds() -> None:
    code = "print('loss' + ' ' * 1_000_000); print('step 1 loss: 0.5')"

    done = subprocess.run(
        [sys.executable, "-m", "detctx", "run", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )

    assert done.returncode == 0, done.stderr


def test_a_user_pattern_that_backtracks_only_sees_the_start_of_each_line(tmp_path: Path) -> None:
    # Quadratic in the spaces after "x": 10**6 of them would take days; 4,096 take a moment.
    log = write(tmp_path / "a.log", "x" + " " * 1_000_000 + "\nx 7\n")

    done = compare_in_a_child(str(log), str(log), "--pattern", r"x\s*\s*(\d+)")

    assert done.returncode == 0, done.stderr
    assert "1 metric value (first 7, last 7)" in done.stdout


def test_a_user_pattern_does_not_read_a_metric_past_its_reach(tmp_path: Path, capsys) -> None:
    within = write(tmp_path / "within.log", "y" * (PATTERN_REACH - 10) + " v=1\n")
    beyond = write(tmp_path / "beyond.log", "y" * PATTERN_REACH + " v=1\n")

    assert cli.main(["compare", str(within), str(within), "--pattern", r"v=(\d)"]) == 0
    assert cli.main(["compare", str(beyond), str(beyond), "--pattern", r"v=(\d)"]) == 2
    assert "no metric lines" in capsys.readouterr().err


def test_a_csv_header_of_200000_columns_is_checked_in_seconds(tmp_path: Path) -> None:
    # 40,000 columns took 29.4 s (quadratic): 200,000 would take over 12 minutes.
    names = [f"c{index}" for index in range(200_000)]
    wide = write(tmp_path / "wide.csv", ",".join(["step", "loss", *names]) + "\n")
    with wide.open("a") as table:
        table.write(",".join(["1", "0.5", *("" for _ in names)]) + "\n")
    twice = write(tmp_path / "twice.csv", ",".join(["step", "loss", *names, "c7"]) + "\n1,2\n")

    done = compare_in_a_child(str(wide), str(wide))
    refused = compare_in_a_child(str(twice), str(twice))

    assert done.returncode == 0, done.stderr
    assert refused.returncode == 2 and "names column 'c7' twice" in refused.stderr


COMMAND = "import pathlib, sys; pathlib.Path(sys.argv[1]).touch(); print('step 1 loss: 0.5')"


@pytest.mark.parametrize("planted", ["run1.log", "run2.log"])
def test_a_link_planted_as_a_run_log_is_refused_before_anything_runs(
    tmp_path: Path, planted: str, capsys
) -> None:
    precious = write(tmp_path / "precious.txt", "keep me")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / planted).symlink_to(precious)
    ran = tmp_path / "ran"

    status = cli.main(
        ["run", "--log-dir", str(logs), "--", sys.executable, "-c", COMMAND, str(ran)]
    )

    assert status == 2
    err = capsys.readouterr().err
    assert f"refusing to write {logs / planted}: it is a symbolic link" in err
    assert "detctx did not create" in err
    assert precious.read_text() == "keep me"
    assert (logs / planted).is_symlink()
    assert not ran.exists()


@pytest.mark.slow
def test_with_locate_planted_links_are_neither_followed_nor_removed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    shim = write(outside / "sitecustomize.py", "# someone else's\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "detctx-site").symlink_to(outside)
    script = write(
        tmp_path / "train.py", "import torch\nprint('step 1 loss:', torch.ones(2).sum().item())\n"
    )

    done = detctx_command(
        "run", "--locate", "--log-dir", str(logs), "--", sys.executable, str(script)
    )

    assert done.returncode == 0, done.stderr
    assert shim.read_text() == "# someone else's\n"
    assert (logs / "detctx-site").is_symlink()
    assert sorted(path.name for path in logs.iterdir()) == [
        "detctx-site",
        "run1.log",
        "run1.trace",
        "run2.log",
        "run2.trace",
    ]


def test_with_locate_a_link_planted_as_a_trace_is_refused(tmp_path: Path, capsys) -> None:
    precious = write(tmp_path / "precious.bin", "keep me")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "run2.trace").symlink_to(precious)
    ran = tmp_path / "ran"

    status = cli.main(
        ["run", "--locate", "--log-dir", str(logs), "--", sys.executable, "-c", COMMAND, str(ran)]
    )

    assert status == 2
    assert "refusing to write" in capsys.readouterr().err
    assert precious.read_text() == "keep me" and (logs / "run2.trace").is_symlink()
    assert not ran.exists()
    assert not [path for path in logs.iterdir() if path.name.startswith("detctx-site")]


def _in_a_child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=GUARD_S,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


@pytest.mark.slow
@pytest.mark.parametrize("locate", [False, True], ids=["run", "run --locate"])
def test_detctx_run_has_not_imported_torch_when_each_run_starts(locate: bool) -> None:
    done = _in_a_child(
        f"""
        import sys
        import detctx._cli.run as run
        from detctx._cli import main

        real = run.run_command
        seen = []

        def watched(*args, **kwargs):
            seen.append(sorted({{"torch", "numpy"}} & set(sys.modules)))
            return real(*args, **kwargs)

        run.run_command = watched
        options = ["--locate"] if {locate} else []
        status = main(["run", *options, "--", sys.executable, "-c", "print('loss: 1.0')"])
        print("status", status, "imported when each run started:", seen)
        """
    )

    assert "imported when each run started: [[], []]" in done.stdout, done.stdout + done.stderr


def test_a_ctrl_c_swallowed_during_start_up_still_stops_detctx_run(tmp_path: Path) -> None:
    # As torch's import did (3 of 35 tries): a handler's KeyboardInterrupt caught and dropped.
    ran = tmp_path / "ran"
    done = _in_a_child(
        f"""
        import os, signal, sys, time
        import detctx._cli.run as run
        from detctx._cli import main

        real = run.determinism_env

        def swallowing(*args, **kwargs):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except KeyboardInterrupt:
                pass
            return real(*args, **kwargs)

        run.determinism_env = swallowing
        code = "import pathlib, sys; pathlib.Path(sys.argv[1]).touch(); print('loss: 1')"
        sys.exit(main(["run", "--", sys.executable, "-c", code, {str(ran)!r}]))
        """
    )

    assert done.returncode == 130, done.stderr
    assert "interrupted" in done.stderr
    assert not ran.exists()


@pytest.mark.slow
def test_a_signal_ignored_when_detctx_run_starts_stays_ignored(tmp_path: Path) -> None:
    # `nohup detctx run ...` ignores SIGHUP: a hangup must not stop the runs (it did, since
    # detctx run put its own handler in place of the ignored one and forwarded the signal).
    started = tmp_path / "started"
    code = (
        "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(1); "
        "print('loss: 0.5')"
    )
    runner = subprocess.Popen(
        [sys.executable, "-m", "detctx", "run", "--", sys.executable, "-c", code, str(started)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    deadline = time.monotonic() + GUARD_S
    while not started.exists():
        assert runner.poll() is None and time.monotonic() < deadline, runner.communicate()
        time.sleep(0.05)

    runner.send_signal(signal.SIGHUP)
    out, err = runner.communicate(timeout=GUARD_S)

    assert runner.returncode == 0, err
    assert "agree" in out
