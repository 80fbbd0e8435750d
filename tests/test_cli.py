"""The ``detctx`` command, run as users run it: a real subprocess, real exit codes."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from detctx import _cli as cli
from detctx._cli import demo
from detctx._cli.curves import compile_pattern, extract
from detctx._proving.doctor import Diagnosis, advise, diagnose

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def detctx_command(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "detctx", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def megatron_log(path: Path, losses: list[str]) -> Path:
    lines = [
        f" iteration {step:>8}/     100 | consumed samples: {step * 64:>10} | "
        f"learning rate: 1.500000E-04 | global batch size:    64 | lm loss: {loss} | "
        "loss scale: 1.0 | grad norm: 2.345 |"
        for step, loss in enumerate(losses, start=1)
    ]
    lines.insert(2, " validation loss at iteration 2 | lm loss value: 9.9E+00 | lm loss PPL: 2 |")
    path.write_text("\n".join(["using world size: 8", *lines, "training done"]) + "\n")
    return path


TRAIN_SCRIPT = """
import os, random, sys
rng = random.Random(int(os.environ["DETCTX_SEED"]))
# Iterating a set of strings follows the hash seed: it repeats only with a fixed PYTHONHASHSEED.
order = list({"alpha", "beta", "gamma", "delta"})
for step in range(1, 6):
    loss = rng.random() + order.index("alpha") * 1e-3
    if "--unseeded" in sys.argv and step >= 3:
        loss += int.from_bytes(os.urandom(4), "little") * 1e-12
    print(f"step {step} loss: {loss!r}", flush=True)
"""


@pytest.fixture
def train_script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN_SCRIPT))
    return script


def test_run_reports_that_a_seeded_command_agrees_and_exits_0(train_script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "DETCTX_SEED")}
    result = detctx_command(
        "run",
        "--seed",
        "7",
        "--log-dir",
        str(tmp_path / "logs"),
        "--",
        sys.executable,
        str(train_script),
        env=env,
    )

    assert result.returncode == 0, result.stderr
    assert "agree bit for bit on all 5 metric values" in result.stdout
    assert "DETCTX_SEED=7 PYTHONHASHSEED=7" in result.stderr
    assert "run 1: 5 metric values" in result.stderr  # progress
    assert (tmp_path / "logs" / "run2.log").read_text().count("loss:") == 5


def test_run_names_the_first_step_where_runs_diverge_and_exits_1(train_script):
    result = detctx_command("run", "-n", "3", "--", sys.executable, str(train_script), "--unseeded")

    assert result.returncode == 1, result.stderr
    assert (
        "first divergence at point 3 of 5 (logged as step 3, line 3 of run 1): "
        "run 2, run 3 part from run 1 there" in result.stdout
    )


def test_compare_plots_diverging_logs_to_a_png_and_exits_1(tmp_path):
    a = megatron_log(tmp_path / "a.log", ["1.0E+01", "9.0E+00", "8.0E+00", "7.0E+00"])
    b = megatron_log(tmp_path / "b.log", ["1.0E+01", "9.0E+00", "8.000001E+00", "7.1E+00"])
    picture = tmp_path / "curves.png"

    result = detctx_command("compare", str(a), str(b), "--plot", str(picture))

    assert result.returncode == 1, result.stderr
    assert "first divergence at point 3 of 4 (logged as step 3" in result.stdout
    assert "2 of 4 points differ" in result.stdout
    assert picture.read_bytes().startswith(PNG_SIGNATURE)
    image = pytest.importorskip("matplotlib.image").imread(str(picture))
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_compare_a_missing_log_is_one_line_on_stderr_and_exits_2(tmp_path):
    a = megatron_log(tmp_path / "a.log", ["1.0"])

    result = detctx_command("compare", str(a), str(tmp_path / "missing.log"))

    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"detctx: error: no such log file: {tmp_path / 'missing.log'}"
    ]


@pytest.mark.slow
def test_doctor_prints_a_report_and_warns_about_hccl_and_hash_seeds():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update(HCCL_DETERMINISTIC="1", HCCL_LOGIC_SUPERPOD_ID="pod0")

    result = detctx_command("doctor", "--json", env=env)

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {
        "versions",
        "build",
        "devices",
        "cpu",
        "flags",
        "environment",
        "warnings",
    }
    assert report["environment"]["HCCL_DETERMINISTIC"] == "1"
    warnings = "\n".join(report["warnings"])
    assert "HCCL_DETERMINISTIC=1 is not a value torch_npu accepts" in warnings
    assert "HCCL_LOGIC_SUPERPOD_ID is set" in warnings
    assert "hash randomisation is on" in warnings


@pytest.mark.slow
def test_demo_shows_bit_identical_curves_and_where_they_diverge_without_detctx(tmp_path):
    pytest.importorskip("matplotlib")
    picture = tmp_path / "demo.png"
    result = detctx_command("demo", "--plot", str(picture))

    assert result.returncode == 0, result.stderr
    assert "run 1 and run 2 agree bit for bit at all 12 steps" in result.stdout
    assert "eval unscoped: diverges at step 5" in result.stdout
    assert "no seeding:    diverges at step" in result.stdout
    assert f"plot written to {picture}" in result.stdout
    assert picture.read_bytes().startswith(PNG_SIGNATURE)
    assert "s since detctx started:" in result.stdout
    assert "s importing torch and detctx" in result.stdout


@pytest.mark.slow
def test_the_demo_counts_its_start_from_detctx_not_from_the_shell_that_started_it():
    # `bash -c "pip install ... && detctx demo"` execs the command in the shell's
    # process: the process's start time would count the install. Here the process
    # (pytest) started long ago; the demo is told it started now.
    out = io.StringIO()

    assert demo.main(out, io.StringIO(), since=time.monotonic()) == 0

    last = out.getvalue().strip().splitlines()[-1]
    started = r"\(\d+\.\d s since detctx started: 0\.0 s importing torch and detctx, .*\)"
    assert re.fullmatch(started, last), last


def test_the_console_script_runs_the_same_entry_point():
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="detctx")

    assert script.value == "detctx._cli:main"


# The cases below call the command's entry point in this process: the same code, faster.


def test_compare_agreeing_logs_exits_0(tmp_path, capsys):
    losses = ["1.034567E+01", "9.876543E+00", "8.765432E+00"]
    a = megatron_log(tmp_path / "a.log", losses)
    b = megatron_log(tmp_path / "b.log", losses)

    assert cli.main(["compare", str(a), str(b)]) == 0
    # Megatron prints 7 significant digits: the runs agree to those, not necessarily in bits
    out = capsys.readouterr().out
    assert "agree at the printed precision (7 significant digits) on all 3 metric values" in out
    assert "print the metric with 9 or more significant digits" in out


def test_a_log_without_metric_lines_is_an_error(tmp_path, capsys):
    (tmp_path / "a.log").write_text("epoch 1 done\n")

    assert cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "a.log")]) == 2
    assert "no metric lines in" in capsys.readouterr().err


def test_a_custom_pattern_reads_another_metric(tmp_path, capsys):
    (tmp_path / "a.log").write_text("acc=0.5\nacc=0.75\n")
    (tmp_path / "b.log").write_text("acc=0.5\nacc=0.75\n")

    assert (
        cli.main(
            [
                "compare",
                "--pattern",
                r"acc=(\S+)",
                *map(str, [tmp_path / "a.log", tmp_path / "b.log"]),
            ]
        )
        == 0
    )


def exit_status(argv: list[str]) -> object:
    try:
        return cli.main(argv)
    except SystemExit as exit:  # argparse's own usage errors
        return exit.code


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--pattern", "loss=(", "a.log", "b.log"], "bad metric pattern"),
        (["run", "-n", "1", "--", "true"], "-n must be at least 2"),
        (["run", "--seed", "-3", "--", "true"], "--seed='-3' is not valid"),
        (["run", "--", "no-such-command-for-detctx"], "command not found"),
        (["run", "--", sys.executable, "-c", "print('no metrics here')"], "no metric lines"),
        (["run", "--", sys.executable, "-c", "raise SystemExit(3)"], "exited with status 3"),
        (["frobnicate"], "invalid choice"),
        (["run", "-n", "2"], "run needs a command after --"),
    ],
)
def test_bad_usage_and_unreadable_curves_exit_2(argv, message, capsys):
    assert exit_status(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "value"),
    [
        (
            " iteration 10/ 100 | lm loss: 1.034567E+01 | loss scale: 1.0 | grad norm: 3.2 |",
            10.34567,
        ),
        (
            "Epoch 0:  50%|#####     | 5/10 [00:00<00:00, v_num=0, train_loss=0.123, val_loss=0.5]",
            0.123,
        ),
        ("Epoch 0:  50%|#####     | 5/10 [00:00<00:00, loss=0.0456, v_num=0]", 0.0456),
        ("{'loss': 0.6931, 'grad_norm': 1.23, 'learning_rate': 5e-05, 'epoch': 0.1}", 0.6931),
        ("loss 0.123", 0.123),
        ("step 3 loss: 0.5", 0.5),
    ],
)
def test_the_default_pattern_reads_common_training_logs(line, value):
    (point,) = extract([line], compile_pattern(None)).points

    assert point.value == value


@pytest.mark.parametrize(
    "line",
    [
        " validation loss at iteration 100 | lm loss value: 5.123E+00 | lm loss PPL: 168 |",
        "{'eval_loss': 0.5, 'eval_runtime': 1.0}",
        "loss scale: 1.0",
        "val_loss=0.3",
    ],
)
def test_the_default_pattern_skips_validation_lines(line):
    assert extract([line], compile_pattern(None)).points == ()


def test_doctor_warns_about_hccl_only_where_it_matters():
    def warnings_for(devices: list[dict[str, object]], **environment: str) -> str:
        report = Diagnosis({}, devices, {}, {"PYTHONHASHSEED": "0", **environment})
        return "\n".join(advise(report))

    npu = [{"type": "npu", "count": 8, "initialised": False}]
    cuda = [{"type": "cuda", "count": 2, "initialised": False}]
    assert "HCCL_DETERMINISTIC is unset" in warnings_for(npu)
    assert warnings_for(npu, HCCL_DETERMINISTIC="true") == ""
    assert "HCCL" not in warnings_for([])
    assert "CUBLAS_WORKSPACE_CONFIG" in warnings_for(cuda, NCCL_NVLS_ENABLE="0")
    assert warnings_for(cuda, NCCL_NVLS_ENABLE="0", CUBLAS_WORKSPACE_CONFIG=":16:8") == ""
    assert "NVLS" in warnings_for(cuda, CUBLAS_WORKSPACE_CONFIG=":4096:8")


def test_plotting_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch):
    log = megatron_log(tmp_path / "a.log", ["1.0"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed

    assert cli.main(["compare", str(log), str(log), "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'detctx[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_doctor_shows_every_variable_a_block_sets_or_puts_back() -> None:
    from detctx._environment import WATCHED, env_switches, inductor

    shown = diagnose().environment
    for name in (*(s.variable for s in env_switches()), inductor.VARIABLE, *WATCHED.variables):
        assert name in shown, name


def test_the_doctor_is_content_with_every_value_a_block_writes_or_keeps() -> None:
    from detctx._environment import env_switches

    devices = [
        {"type": "cuda", "count": 1, "initialised": False},
        {"type": "npu", "count": 1, "initialised": False},
    ]
    for switch in env_switches():
        written = {switch.target(setting, 7, None) for setting in switch.values}
        for value in written | switch.keep:
            report = Diagnosis({}, devices, {}, {switch.variable: value})
            assert not [text for text in advise(report) if switch.variable in text], value
