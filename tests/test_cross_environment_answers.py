"""Runs of two environments: logs that show two are told to expect a difference and pointed
at `detctx record`; torchtitan's coloured console log is read; two machines' doctor reports
are compared side by side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from detctx import _cli as cli
from detctx._cli.doctor_diff import compare_reports
from detctx._proving import diagnose

TITAN_RED, TITAN_GREEN, TITAN_ORANGE, TITAN_RESET = (
    "\033[31m",
    "\033[32m",
    "\033[38;2,180;60,0m",  # torchtitan's own spelling, commas and all
    "\033[39m",
)


def titan_line(step: int, loss: float) -> str:
    """A line of torchtitan's console log, coloured as its MetricsProcessor prints it."""
    return (
        f"[titan] 2026-01-01 10:00:0{step},000 - root - INFO - {TITAN_RED}step: {step:2}  "
        f"{TITAN_GREEN}loss: {loss:8.5f}  {TITAN_ORANGE}grad_norm: {1.5:7.4f}  "
        f"{TITAN_RESET}\n"
    )


def test_two_seeded_runs_on_two_torch_releases_are_told_to_record_not_to_seed(tmp_path, capsys):
    (tmp_path / "old.log").write_text("torch 2.1.2\nstep 0 loss: 0.8154\nstep 1 loss: 0.7\n")
    (tmp_path / "new.log").write_text(
        "PyTorch version: 2.13.0+cpu\nstep 0 loss: 0.7421\nstep 1 loss: 0.6\n"
    )

    status = cli.main(["compare", str(tmp_path / "old.log"), str(tmp_path / "new.log")])

    out = capsys.readouterr().out
    assert status == 1
    assert "the logs show two environments (torch 2.1.2 in old.log, 2.13.0+cpu in new.log)" in out
    assert "are expected to differ" in out and "detctx record" in out
    assert "detctx compare a.trace b.trace" in out
    # the evidence shows two environments: no seeding cause is claimed
    assert "nothing seeds the run" not in out and "did not start from the same state" not in out


def test_logs_that_show_no_environment_get_both_readings_record_first(tmp_path, capsys):
    (tmp_path / "a.log").write_text("step 0 loss: 0.8154\nstep 1 loss: 0.7\n")
    (tmp_path / "b.log").write_text("step 0 loss: 0.7421\nstep 1 loss: 0.6\n")

    assert cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 1

    out = capsys.readouterr().out
    assert "they ran in two environments, or they did not start from the same state" in out
    assert out.index("detctx record") < out.index("If they ran in one environment")
    assert "1. nothing seeds the run" in out


def test_logs_of_two_devices_that_part_later_end_with_the_two_environments(tmp_path, capsys):
    (tmp_path / "a.log").write_text(
        "GPU available: True (cuda), used: True\nloss: 0.8\nloss: 0.7\n"
    )
    (tmp_path / "b.log").write_text("GPU available: False, used: False\nloss: 0.8\nloss: 0.6\n")

    assert cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 1

    out = capsys.readouterr().out
    assert "first divergence at point 2" in out
    assert "Note: the logs show two environments (GPU available True (cuda) in a.log" in out
    assert "detctx record" in out


def test_runs_of_one_environment_under_detctx_run_are_not_told_about_two():
    from detctx._cli.curves import Curve, Point, compare
    from detctx._cli.verdict import describe

    runs = [
        Curve(name, (Point(value, "", 1, None), Point(value, "", 2, None)), {"torch": version})
        for name, value, version in (("run 1", 0.8, "2.1.2"), ("run 2", 0.7, "2.13.0"))
    ]

    text = describe(compare(runs))

    assert "two environments" not in text and "did not start from the same state" in text


def test_a_torchtitan_coloured_console_log_is_read_at_its_five_decimals(tmp_path, capsys):
    (tmp_path / "a.log").write_text(titan_line(1, 8.123456) + titan_line(2, 7.5))
    (tmp_path / "b.log").write_text(titan_line(1, 8.123456) + titan_line(2, 7.5))

    status = cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "b.log")])

    out = capsys.readouterr().out
    assert status == 0
    assert "on all 2 metric values (first 8.12346, last 7.50000)" in out
    assert "The logs print 6 significant digits" in out
    assert "torchtitan prints its loss with 5 decimals" in out


def test_a_torchtitan_coloured_line_under_detctx_run_gives_its_loss_and_step():
    from detctx._cli.curves import compile_pattern, parse_line

    point = parse_line(titan_line(3, 2.25), 1, compile_pattern(None), "run 1")

    assert point is not None and (point.value, point.step) == (2.25, 3)


def test_two_doctor_reports_list_their_differences_side_by_side(tmp_path, capsys):
    here = diagnose().as_dict()
    other = json.loads(json.dumps(here))
    other["versions"]["torch"] = "2.1.2+cu121" if torch.__version__ != "2.1.2+cu121" else "2.13.0"
    built = "12.1" if torch.version.cuda != "12.1" else "11.8"
    other["build"]["torch.version.cuda"] = built
    other["flags"]["torch.backends.mkldnn.enabled"] = False
    for name, report in (("a.json", here), ("b.json", other)):
        (tmp_path / name).write_text(json.dumps(report, default=str))

    status = cli.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])

    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in out.splitlines()[1:]}
    assert status == 1
    assert out.startswith("doctor reports DIFFER in 3 of ")
    assert rows[("versions", "torch")] == [torch.__version__, other["versions"]["torch"]]
    assert rows[("build", "torch.version.cuda")][1] == built
    assert rows[("flags", "torch.backends.mkldnn.enabled")] == ["true", "false"]
    assert "also on a machine without a GPU" in out


def test_doctor_diff_of_one_report_twice_agrees(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(diagnose().as_dict(), default=str))

    status = cli.main(["doctor", "--diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")])

    assert status == 0
    assert "agree on all" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("report", "said"),
    [
        ('{"versions": {}, "flags": [], "environment": {}}', "'flags' is a list, not an object"),
        ('{"versions": {"torch": {"x": 1}}, "flags": {}, "environment": {}}', "is a dict"),
        ('{"versions": {}, "flags": {}}', "is not a detctx doctor report"),
        ('{"versions": {}, "flags": {}, "environment": {}, "devices": 3}', "'devices' is not"),
    ],
)
def test_a_malformed_doctor_report_is_refused_by_name(tmp_path, capsys, report, said):
    (tmp_path / "a.json").write_text(json.dumps(diagnose().as_dict(), default=str))
    (tmp_path / "b.json").write_text(report)

    status = cli.main(["doctor", "--diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")])

    assert status == 2
    assert said in capsys.readouterr().err


def test_a_doctor_report_and_a_trainer_state_are_not_compared(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(diagnose().as_dict(), default=str))
    (tmp_path / "b.json").write_text('{"log_history": [{"loss": 0.5, "step": 1}]}')

    status = cli.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])

    assert status == 2
    assert "is a detctx doctor report but" in capsys.readouterr().err


def test_doctor_reports_the_build_apart_from_the_devices_and_the_kernel_switches():
    report = diagnose()
    text = report.format()

    assert report.build["torch.version.cuda"] == torch.version.cuda
    assert "build (what torch was compiled with, not the devices this machine has)" in text
    for name in (
        "torch.get_num_threads",
        "torch.backends.mkldnn.enabled",
        "torch.backends.cuda.math_sdp_enabled",
        "torch.backends.cuda.matmul.allow_tf32",
        "torch.backends.cudnn.allow_tf32",
    ):
        assert name in report.flags
    assert {"model", "logical cores", "ISA flags"} <= set(report.cpu)


@pytest.mark.slow
def test_doctors_of_two_processes_one_with_onednn_off_differ_by_that_row(tmp_path):
    script = (
        "import json, sys, torch\n"
        "torch.backends.mkldnn.enabled = sys.argv[1] == 'on'\n"
        "from detctx._proving import diagnose\n"
        "print(json.dumps(diagnose(read_device_names=True).as_dict(), default=str))\n"
    )
    reports = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", script, state],
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            ).stdout
        )
        for state in ("on", "off")
    ]

    text, agree = compare_reports(reports, ["on.json", "off.json"])

    assert not agree
    assert text.splitlines()[2].split() == [
        "flags",
        "torch.backends.mkldnn.enabled",
        "true",
        "false",
    ]
    assert "DIFFER in 1 of" in text


def test_compare_help_describes_traces_as_well_as_logs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])

    out = " ".join(capsys.readouterr().out.split())
    assert "a trace or a folder of rank traces written by detctx record" in out
    assert "the first op whose error its inputs do not explain" in out
    assert "a detctx doctor --json report" in out


def test_a_trainer_state_that_mentions_a_reports_words_is_still_read_as_one(tmp_path, capsys):
    state = {
        "log_history": [
            {"loss": 0.6931471805599453, "step": 1, "versions": 1, "flags": 2, "environment": 3}
        ]
    }
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(state))

    status = cli.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])

    assert status == 0
    assert "agree bit for bit on all 1 metric value" in capsys.readouterr().out


def test_torchtitans_validation_lines_are_not_read_as_training_losses(tmp_path, capsys):
    validation = (
        f"[titan] ... - root - INFO - {TITAN_RED}validate step: 2  {TITAN_GREEN}loss: 9.99999\n"
    )
    for name in ("a.log", "b.log"):
        (tmp_path / name).write_text(titan_line(1, 8.5) + validation + titan_line(2, 7.5))

    status = cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "b.log")])

    assert status == 0
    assert "on all 2 metric values (first 8.50000, last 7.50000)" in capsys.readouterr().out
