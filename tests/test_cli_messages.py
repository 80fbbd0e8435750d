"""What ``detctx`` tells a newcomer: what was compared, what to do, what it cost, the plot."""

from __future__ import annotations

import io
import sys
import time

import pytest

from detctx import _cli as cli
from detctx._cli.curves import Curve, Point, compare, printed_digits, significant_digits
from detctx._cli.plotting import title
from detctx._cli.run import Progress
from detctx._cli.verdict import describe

LIGHTNING_OUTPUT = """\
print("GPU available: False, used: False")
print("`Trainer.fit` stopped: `max_epochs=3` reached.")
"""

TRAINER_OUTPUT = """\
print("***** Running training *****")
print({'train_runtime': '1.2', 'train_samples_per_second': '3.4'})
"""


def curve(name: str, values: list[float], *, texts: list[str] | None = None) -> Curve:
    shown = texts or [repr(value) for value in values]
    return Curve(
        name,
        tuple(
            Point(value, text, step, step)
            for step, (value, text) in enumerate(zip(values, shown), 1)
        ),
    )


def test_rounded_logs_agree_at_their_printed_precision_not_bit_for_bit(tmp_path, capsys):
    for name in ("a.log", "b.log"):
        (tmp_path / name).write_text("{'loss': '0.6704'}\n{'loss': '0.6512'}\n")

    assert cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 0

    out = capsys.readouterr().out
    assert "2 curves agree at the printed precision (4 significant digits) on all 2" in out
    assert "bit for bit" not in out
    assert "CSVLogger metrics.csv" in out and "trainer_state.json" in out


def test_logs_printed_in_full_still_agree_bit_for_bit(tmp_path, capsys):
    for name in ("a.log", "b.log"):
        (tmp_path / name).write_text("loss: 0.6931471824645996\nloss: 0.25\n")

    assert cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 0
    assert "2 curves agree bit for bit on all 2" in capsys.readouterr().out


def test_significant_digits_are_counted_as_printed() -> None:
    assert [
        significant_digits(text)
        for text in ("0.6704", "1.234567E+00", "0.5000", "0.0012", "-3", "nan", "0.0")
    ] == [4, 7, 4, 2, 1, None, None]
    assert printed_digits([curve("a", [0.5, 0.25], texts=["0.5", "0.250"])]) == 3
    assert printed_digits([curve("a", [0.6931471824645996])]) is None


@pytest.mark.parametrize(
    ("output", "advice"),
    [
        (LIGHTNING_OUTPUT, "prog_bar=True"),
        (LIGHTNING_OUTPUT, "lightning_logs/version_0/metrics.csv"),
        (TRAINER_OUTPUT, "logging_steps"),
        (TRAINER_OUTPUT, "trainer_state.json"),
        ("print('epoch 1 done')", "pass --pattern to match your log"),
    ],
)
def test_a_run_without_metric_lines_says_what_to_do_for_the_framework_it_sees(
    tmp_path, capsys, output, advice
):
    script = tmp_path / "train.py"
    script.write_text(output)

    assert cli.main(["run", "--", sys.executable, str(script)]) == 2

    error = capsys.readouterr().err
    assert "no metric lines in the output of run 1" in error
    assert advice in error


def test_compare_of_a_lightning_log_without_metric_lines_suggests_its_csv_logger(tmp_path, capsys):
    log = tmp_path / "fit.log"
    log.write_text("GPU available: False, used: False\nEpoch 2/2 8/8 0:00:00\n")

    assert cli.main(["compare", str(log), str(log)]) == 2
    assert "CSVLogger" in capsys.readouterr().err


def test_a_short_run_reports_its_progress_once_not_twice() -> None:
    stream = io.StringIO()
    now = time.monotonic()
    progress = Progress("run 1", stream, started=now - 3.2, last_report=now - 3.2)

    progress.update(Point(0.5, "0.5", 1, 1))  # due: the last report was 3 s ago
    progress.update(None, final=True)  # the same words: not written again

    assert stream.getvalue().splitlines() == ["run 1: 1 metric value, latest 0.5 at step 1 (3 s)"]


def test_the_plot_title_says_which_runs_agree_and_where_each_other_one_parts() -> None:
    losses = [0.6931471824645996, 0.6512345671653748, 0.5987654328346252, 0.5123456716537476]
    run1, run2 = curve("run 1", losses), curve("run 2", losses)
    late = curve("eval unscoped", [*losses[:2], 0.5987654923439026, 0.5123457312583923])
    unseeded = curve("no seeding", [0.7931471824645996, *losses[1:]])

    assert title(compare([run1, run2]), "training loss") == (
        "training loss: run 1 and run 2 agree bit for bit (both, at all 4 steps)"
    )
    assert title(compare([run1, run2, late, unseeded]), "training loss").splitlines() == [
        "training loss: run 1 and run 2 agree bit for bit at all 4 steps",
        "first divergence between run 1 and eval unscoped at step 3",
        "first divergence between run 1 and no seeding at step 1",
    ]
    rounded = [curve(name, [0.67], texts=["0.6704"]) for name in ("a", "b")]
    assert "agree to the 4 significant digits printed" in title(compare(rounded))


def test_the_command_help_names_every_argument_as_the_usage_does(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "-h"])
    run_help = capsys.readouterr().out
    assert "[-n N] [--seed S]" in run_help and "-n N, --runs N" in run_help
    assert "--seed S " in run_help and "--log-dir DIR " in run_help

    with pytest.raises(SystemExit):
        cli.main(["compare", "-h"])
    assert "trainer_state.json or a folder" in capsys.readouterr().out


def test_with_three_runs_the_verdict_names_the_run_that_parted_and_the_one_that_agrees():
    runs = [curve("run 1", [0.9, 0.8, 0.7]), curve("run 2", [0.9, 0.8, 0.7])]
    runs.append(curve("run 3", [0.9, 0.8, 0.75]))

    text = describe(compare(runs))

    # points count from 1; the step is the log's own label, said to be one
    assert (
        "first divergence at point 3 of 3 (logged as step 3, line 3 of run 1): "
        "run 3 parts from run 1 there (run 2 still agrees)" in text
    )


def test_runs_that_differ_from_the_first_point_come_with_the_likely_causes_in_order(
    tmp_path, capsys
):
    (tmp_path / "a.log").write_text("step 0 loss: 0.8154\nstep 1 loss: 0.7\n")
    (tmp_path / "b.log").write_text("step 0 loss: 0.7421\nstep 1 loss: 0.6\n")

    assert cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 1

    out = capsys.readouterr().out
    # logs may come from two machines: both readings are given, one environment's causes last
    assert "they ran in two environments, or they did not start from the same state" in out
    assert "If they ran in one environment: Likely causes" in out
    order = ("1. nothing seeds", "2. the model or the data", "3. something read entropy")
    causes = [out.index(cause) for cause in order]
    assert causes == sorted(causes)


def test_runs_that_part_later_get_no_advice_about_seeding(tmp_path, capsys):
    (tmp_path / "a.log").write_text("loss: 0.8\nloss: 0.7\n")
    (tmp_path / "b.log").write_text("loss: 0.8\nloss: 0.6\n")

    assert cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 1
    assert "nothing seeds" not in capsys.readouterr().out


def test_an_unseeded_script_run_twice_is_told_it_does_not_seed(capsys):
    script = "import random; print('loss:', random.random())"

    assert cli.main(["run", "--", sys.executable, "-c", script]) == 1

    out = capsys.readouterr().out
    assert "first divergence at point 1 of 1" in out
    assert "No run entered a detctx block or called detctx.seed_all" in out
