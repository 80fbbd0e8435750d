"""The ``detctx`` command at its edges: signals, huge lines, bad plot paths, short logs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from test_cli import megatron_log

from detctx import __version__
from detctx import _cli as cli
from detctx._cli import curves
from detctx._cli import run as repeat
from detctx._cli.curves import compile_pattern
from detctx._cli.lines import LineReader

# A command that writes its pid, then a loss line, then waits to be stopped.
WAITING_SCRIPT = """
import os, signal, sys, time
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "w") as out:
    out.write(str(os.getpid()))
print("step 1 loss: 1.0", flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): read its state where /proc exists.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def start_detctx_run(tmp_path: Path, *script_args: str) -> tuple[subprocess.Popen[str], int]:
    """``detctx run`` of the waiting script; returns it and the script's pid once started."""
    script = tmp_path / "wait.py"
    script.write_text(textwrap.dedent(WAITING_SCRIPT))
    pid_file = tmp_path / "pid"
    command = [sys.executable, str(script), str(pid_file), *script_args]
    runner = subprocess.Popen(
        [sys.executable, "-m", "detctx", "run", "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()):
        assert runner.poll() is None, runner.communicate()
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    return runner, int(pid_file.read_text())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_kill_of_detctx_run_stops_the_command_and_exits_128_plus_the_signal(tmp_path, signum):
    runner, child = start_detctx_run(tmp_path)

    runner.send_signal(signum)
    _, err = runner.communicate(timeout=60)

    assert runner.returncode == 128 + signum, err
    assert f"stopped by {signal.Signals(signum).name}" in err
    assert not alive(child)


@pytest.mark.slow
def test_a_command_that_ignores_sigterm_is_killed_after_a_short_wait(tmp_path):
    runner, child = start_detctx_run(tmp_path, "--ignore-term")

    runner.send_signal(signal.SIGTERM)
    runner.communicate(timeout=60)

    assert runner.returncode == 128 + signal.SIGTERM
    assert not alive(child)


def test_reading_a_huge_line_costs_time_linear_in_its_length(monkeypatch):
    # Count the characters searched for line ends: re-splitting the unfinished line on
    # every chunk (the old way) searches about length**2 / (2 * chunk) of them.
    searched = 0
    real_split = curves.split_lines

    def counting_split(text: str) -> list[str]:
        nonlocal searched
        searched += len(text)
        return real_split(text)

    monkeypatch.setattr("detctx._cli.lines.split_lines", counting_split)
    length = 8_000_000
    code = f"import sys; sys.stdout.write('x' * {length} + ' loss: 0.5\\n' + 'step 2 loss: 0.25')"

    curve = repeat.run_command(
        [sys.executable, "-c", code], os.environ, compile_pattern(None), "run 1"
    )

    assert [point.value for point in curve.points] == [0.5, 0.25]
    assert searched <= length + 100


def test_line_ends_and_characters_split_across_chunks_are_read_whole():
    reader = LineReader()
    text = "loss: 1\r\nétape loss: 2\rloss: 3\nlast".encode()
    lines: list[str] = []
    for index in range(len(text)):  # one byte per chunk: every split there is
        lines += reader.feed(reader.decode(text[index : index + 1]))
    lines += reader.finish()

    assert lines == ["loss: 1", "étape loss: 2", "loss: 3", "last"]


def test_a_failed_run_that_printed_nothing_says_so(capsys):
    status = cli.main(["run", "--", sys.executable, "-c", "raise SystemExit(4)"])

    err = capsys.readouterr().err
    assert status == 2
    assert "exited with status 4; it printed nothing" in err
    assert "its last lines" not in err


def test_a_failed_runs_huge_last_line_is_cut_short_in_the_message(capsys):
    code = "print('x' * 100000); raise SystemExit(1)"

    assert cli.main(["run", "--", sys.executable, "-c", code]) == 2
    err = capsys.readouterr().err
    assert "(100000 characters)" in err
    assert len(err) < 2000


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("missing-folder/curves.png", "does not exist; create it first"),
        ("curves.txt", "matplotlib writes no '.txt' images; end the name with .png, .svg or .pdf"),
        ("curves", "the name has no suffix, and the suffix says which image format to write"),
        (".", "is a folder"),
    ],
)
def test_a_bad_plot_path_is_refused_before_the_first_run(tmp_path, capsys, target, message):
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w'); print('loss: 1')"]

    status = cli.main(["run", "--plot", str(tmp_path / target), "--", *command])

    assert status == 2
    assert message in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize(("suffix", "signature"), [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_the_plot_suffix_names_the_format_written(tmp_path, suffix, signature):
    pytest.importorskip("matplotlib")
    log = megatron_log(tmp_path / "a.log", ["1.0", "0.5"])
    picture = tmp_path / f"curves{suffix}"

    assert cli.main(["compare", str(log), str(log), "--plot", str(picture)]) == 0
    assert picture.read_bytes().startswith(signature)


def test_a_plot_that_cannot_be_written_at_the_end_keeps_the_verdict(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    a = megatron_log(tmp_path / "a.log", ["1.0", "0.5"])
    b = megatron_log(tmp_path / "b.log", ["1.0", "0.75"])

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "plot", disk_full)

    assert cli.main(["compare", str(a), str(b), "--plot", str(tmp_path / "p.png")]) == 1


def test_compare_of_a_full_log_against_a_truncated_one_says_where_it_ends(tmp_path, capsys):
    full = megatron_log(tmp_path / "full.log", ["1.0", "0.9", "0.8", "0.7", "0.6"])
    cut = megatron_log(tmp_path / "cut.log", ["1.0", "0.9", "0.8"])

    assert cli.main(["compare", str(full), str(cut)]) == 1
    out = capsys.readouterr().out
    assert "curves DIFFER in length: 5 points in the longest" in out
    assert "cut.log ends after point 3 (step 3, line 5)" in out  # named by what tells it apart
    assert "The 3 points all curves have agree at the printed precision (2 significant" in out
    assert "max abs difference 0" not in out


def test_compare_of_a_truncated_log_that_also_diverges_reports_both(tmp_path, capsys):
    full = megatron_log(tmp_path / "full.log", ["1.0", "0.9", "0.8", "0.7"])
    cut = megatron_log(tmp_path / "cut.log", ["1.0", "0.95"])

    assert cli.main(["compare", str(full), str(cut)]) == 1
    out = capsys.readouterr().out
    assert "cut.log ends after point 2" in out
    assert "Within the 2 points all curves have: first divergence at point 2" in out
    assert "max abs difference 0.05" in out


def test_one_metric_value_is_one_value(tmp_path, capsys):
    log = megatron_log(tmp_path / "a.log", ["1.0"])

    assert cli.main(["compare", str(log), str(log)]) == 0
    assert "on all 1 metric value (" in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--version", "-V"])
def test_detctx_version_prints_the_version(option, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([option])

    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"detctx {__version__}"


def test_run_with_one_run_prints_runs_usage_not_the_top_level_one(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "-n", "1", "--", "true"])

    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("usage: detctx run ")
    assert "-n must be at least 2" in err


def test_run_without_a_command_prints_runs_usage(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "-n", "2"])

    assert capsys.readouterr().err.startswith("usage: detctx run ")


def test_the_demo_accepts_a_plot_and_checks_it_first(tmp_path, capsys):
    status = cli.main(["demo", "--plot", str(tmp_path / "demo.txt")])

    assert status == 2
    assert "matplotlib writes no '.txt' images" in capsys.readouterr().err


@given(
    st.text(alphabet=st.sampled_from(["a", "é", "\r", "\n", " ", "1", "€"]), max_size=60),
    st.lists(st.integers(1, 7), min_size=1, max_size=30),
)
@example("\r\n", [1])  # a \r\n split across two reads is one line end, not two
@example("a\r\nb\r", [2, 1])
def test_any_chunking_gives_the_lines_of_the_whole_text(text: str, sizes: list[int]) -> None:
    data = text.encode()
    reader = LineReader()
    lines: list[str] = []
    start = 0
    for size in sizes * (len(data) // max(sum(sizes), 1) + 1):
        lines += reader.feed(reader.decode(data[start : start + size]))
        start += size
    lines += reader.feed(reader.decode(data[start:]))
    lines += reader.finish()

    whole = curves.split_lines(text)
    expected = whole if whole[-1] else whole[:-1]
    assert lines == expected
