"""``detctx compare``'s messages read by a newcomer: what it looked for, what the table's
marks mean, and file names short enough for the table and the plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from detctx import _cli as cli
from detctx._cli.curves import short_names


def write_metrics(folder: Path, losses: list[str]) -> Path:
    path = folder / "lightning_logs" / "version_0" / "metrics.csv"
    path.parent.mkdir(parents=True)
    path.write_text("step,train_loss\n" + "".join(f"{s},{v}\n" for s, v in enumerate(losses)))
    return path


def test_metric_lr_reads_a_log_that_prints_lr_and_a_space(tmp_path, capsys):
    for name in ("a.log", "b.log"):
        (tmp_path / name).write_text("step 1 lr 3e-4 loss: 0.5\nstep 2 lr 1e-4 loss: 0.4\n")

    status = cli.main(
        ["compare", "--metric", "lr", *(str(tmp_path / n) for n in ("a.log", "b.log"))]
    )

    assert status == 0
    assert "on all 2 metric values (first 3e-4, last 1e-4)" in capsys.readouterr().out


def test_a_metric_no_line_has_is_named_in_words_not_as_a_regular_expression(tmp_path, capsys):
    for name in ("a.log", "b.log"):
        (tmp_path / name).write_text("step 1 loss: 0.5\n")

    status = cli.main(
        ["compare", "--metric", "lr", str(tmp_path / "a.log"), str(tmp_path / "b.log")]
    )

    err = capsys.readouterr().err
    assert status == 2
    assert "looked for --metric lr: lines such as 'lr: 0.5', 'lr=0.5' or 'lr 0.5'" in err
    assert "(?" not in err and "\\s" not in err


@pytest.mark.parametrize("longer", ["first", "second"])
def test_curves_of_different_lengths_explain_only_the_marks_the_table_shows(
    tmp_path, capsys, longer
):
    (tmp_path / "long.log").write_text("loss: 0.5\nloss: 0.4\nloss: 0.3\n")
    (tmp_path / "short.log").write_text("loss: 0.5\nloss: 0.4\n")
    logs = ["long.log", "short.log"] if longer == "first" else ["short.log", "long.log"]

    assert cli.main(["compare", *(str(tmp_path / log) for log in logs)]) == 1

    out = capsys.readouterr().out
    table = out.split("curves DIFFER")[0]
    rows = table.splitlines()[2:-1]
    assert "- the curve has no such point)" in out
    # a star is explained exactly when a row shows one (the first curve is never starred)
    assert any(row.endswith(" *") for row in rows) == ("* differs from the first curve" in out)
    assert ("* differs" in out) == (longer == "second")


def test_a_value_that_differs_is_starred_and_the_star_explained(tmp_path, capsys):
    (tmp_path / "a.log").write_text("loss: 0.5\nloss: 0.4\n")
    (tmp_path / "b.log").write_text("loss: 0.5\nloss: 0.41\n")

    assert cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 1

    out = capsys.readouterr().out
    assert "0.41 *" in out and "(* differs from the first curve)" in out
    assert "no such point" not in out


def test_absolute_paths_are_cut_to_what_tells_the_files_apart_in_the_table(tmp_path, capsys):
    first = write_metrics(tmp_path / "experiments" / "run1", ["0.5", "0.4"])
    second = write_metrics(tmp_path / "experiments" / "run2", ["0.5", "0.41"])

    assert cli.main(["compare", str(first), str(second)]) == 1

    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("point "))
    assert header.split() == ["point", "run1/.../metrics.csv", "run2/.../metrics.csv"]
    assert str(tmp_path) not in out


@pytest.mark.parametrize(
    ("names", "shown"),
    [
        (["/data/a.log", "/data/b.log"], ["a.log", "b.log"]),
        (
            ["/x/r1/logs/v0/metrics.csv", "/x/r2/logs/v0/metrics.csv"],
            ["r1/.../metrics.csv", "r2/.../metrics.csv"],
        ),
        (["/x/r1/metrics.csv", "/x/r2/metrics.csv"], ["r1/metrics.csv", "r2/metrics.csv"]),
        (["run 1", "run 2"], ["run 1", "run 2"]),
        (["same.log", "same.log"], ["same.log", "same.log"]),
        (["/a/x.log", "/b/x.log", "/b/y.log"], ["a/x.log", "b/x.log", "b/y.log"]),
    ],
)
def test_short_names_keep_every_file_told_apart(names, shown):
    assert short_names(names) == shown


def test_the_plot_of_two_deep_paths_keeps_its_title_and_labels_inside_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    first = write_metrics(tmp_path / ("a" * 30) / "run1", ["0.5", "0.4", "0.3"])
    second = write_metrics(tmp_path / ("a" * 30) / "run2", ["0.5", "0.4", "0.31"])
    outside: list[str] = []
    titles: list[str] = []
    savefig = Figure.savefig

    def check(figure: Figure, *args: object, **kwargs: object) -> None:
        savefig(figure, *args, **kwargs)
        renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
        box = figure.bbox
        for axes in figure.axes:
            titles.append(axes.get_title())
            for text in (axes.title, axes.xaxis.label, axes.yaxis.label):
                extent = text.get_window_extent(renderer)
                inside = box.x0 <= extent.x0 and extent.x1 <= box.x1
                if text.get_text() and not (inside and box.y0 <= extent.y0 <= extent.y1 <= box.y1):
                    outside.append(text.get_text())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", check)
        assert (
            cli.main(["compare", str(first), str(second), "--plot", str(tmp_path / "p.png")]) == 1
        )

    assert outside == []
    assert "run2/.../metrics.csv" in titles[0]
