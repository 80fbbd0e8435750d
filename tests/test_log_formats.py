"""The logs users already have: their framework's log lines and metric files, as they are."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

import detctx
from detctx import _cli as cli
from detctx._cli.curves import compile_pattern, parse_line

LIGHTNING_CSV = textwrap.dedent(
    """\
    epoch,step,train_loss,val_loss
    0,0,1.4662816524505615,
    0,1,0.9253614544868469,
    0,1,,0.5999135375022888
    1,2,0.9540166258811951,
    1,3,0.284417986869812,
    1,3,,0.5312808156013489
    """
)


def trainer_state(losses, eval_losses=()):
    """A trainer_state.json as transformers writes it (indent=2, sorted keys)."""
    history = []
    for step, loss in enumerate(losses, start=1):
        history.append(
            {
                "epoch": step / 8,
                "grad_norm": 2.5,
                "learning_rate": 5e-05,
                "loss": loss,
                "step": step,
            }
        )
        if step % 2 == 0 and eval_losses:
            history.append(
                {"epoch": step / 8, "eval_loss": eval_losses[step // 2 - 1], "step": step}
            )
    history.append({"epoch": 1.0, "step": len(losses), "train_loss": 3.5, "train_runtime": 1.5})
    state = {"best_metric": None, "global_step": len(losses), "log_history": history}
    return json.dumps(state, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize(
    ("line", "value"),
    [
        ("Loss: 0.5", 0.5),
        ("LOSS=0.25", 0.25),
        ("loss=0.5", 0.5),
        ("Epoch 1: 100%|##########| 10/10 [00:01<00:00, v_num=0, train_loss=0.284]", 0.284),
        ("step 7 loss: tensor(0.5000)", 0.5),
        ("loss: tensor(1.2500, grad_fn=<NllLossBackward0>)", 1.25),
        (
            "{'loss': '0.6704', 'grad_norm': '1.23', 'learning_rate': '5e-05', 'epoch': '0.1'}",
            0.6704,
        ),
        ("Train Loss: 1e-3", 0.001),
        ("Step 3 Loss: -inf", float("-inf")),
    ],
)
def test_the_default_pattern_reads_losses_in_any_case_and_the_transformers_5_form(line, value):
    point = parse_line(line, 1, compile_pattern(None), "log")
    assert point is not None
    assert point.value == value


@pytest.mark.parametrize(
    "line",
    [
        "VAL_LOSS=0.3",
        "{'eval_loss': '0.5', 'eval_runtime': '0.13', 'epoch': '0.5'}",
        "Test_Loss: 0.1",
        "Loss Scale: 65536.0",
        "computing the loss information for step 3",
    ],
)
def test_the_default_pattern_still_skips_validation_losses_and_the_loss_scale(line):
    assert parse_line(line, 1, compile_pattern(None), "log") is None


def test_run_reads_the_quoted_log_lines_transformers_5_prints(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(
        "for step in range(1, 4):\n"
        "    print({'loss': f'{0.7 - step / 100:.4g}', 'grad_norm': '1.2', 'epoch': str(step)})\n"
        "    print({'eval_loss': '9.9', 'epoch': str(step)})\n"
    )
    assert cli.main(["run", "--", sys.executable, str(script)]) == 0
    out = capsys.readouterr().out
    # transformers 5.x rounds what it prints: the verdict says so, and where the bits are
    assert "agree at the printed precision (2 significant digits) on all 3 metric values" in out
    assert "trainer_state.json" in out and "bit for bit" not in out


def test_compare_reads_two_lightning_metrics_csv_files(tmp_path, capsys):
    (tmp_path / "a.csv").write_text(LIGHTNING_CSV)
    (tmp_path / "b.csv").write_text(LIGHTNING_CSV.replace("0.284417986869812", "0.2844179868698"))

    assert cli.main(["compare", str(tmp_path / "a.csv"), str(tmp_path / "a.csv")]) == 0
    assert "agree bit for bit on all 4 metric values" in capsys.readouterr().out
    assert cli.main(["compare", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 1
    out = capsys.readouterr().out
    assert "first divergence at point 4 of 4 (logged as step 3, line 6 of" in out
    assert (
        cli.main(
            ["compare", "--metric", "val_loss", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]
        )
        == 0
    )
    assert "agree bit for bit on all 2 metric values" in capsys.readouterr().out


def test_compare_reads_trainer_state_json_log_history_and_names_the_diverging_entry(
    tmp_path, capsys
):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "trainer_state.json").write_text(
        trainer_state([3.5, 3.25, 3.0, 2.75], [3.4, 3.1])
    )
    (tmp_path / "b.json").write_text(trainer_state([3.5, 3.25, 3.0, 2.5], [3.4, 3.1]))

    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b.json")]) == 1
    out = capsys.readouterr().out
    assert "first divergence at point 4 of 4 (logged as step 4, log_history entry 5 of" in out
    assert (
        cli.main(
            ["compare", "--metric", "eval_loss", str(tmp_path / "a"), str(tmp_path / "b.json")]
        )
        == 0
    )
    assert (
        "agree at the printed precision (2 significant digits) on all 2 metric values "
        "(first 3.4, last 3.1)" in capsys.readouterr().out
    )


def test_metric_picks_a_named_value_out_of_text_logs_too(tmp_path, capsys):
    lines = "{'loss': '0.7', 'epoch': '1'}\n{'eval_loss': '0.65', 'eval_runtime': '0.1'}\n"
    (tmp_path / "a.log").write_text(lines)
    (tmp_path / "b.log").write_text(lines.replace("0.65", "0.66"))

    assert cli.main(["compare", str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 0
    capsys.readouterr()
    assert (
        cli.main(
            ["compare", "--metric", "eval_loss", str(tmp_path / "a.log"), str(tmp_path / "b.log")]
        )
        == 1
    )


MALFORMED = [
    ("metrics.csv", "", "is empty: expected a CSV header row"),
    ("metrics.csv", "step,loss,loss\n1,2,3\n", "names column 'loss' twice"),
    ("metrics.csv", "step,train_loss\n0,0.5\n1,0.4,9\n", "line 3: 3 fields, but the header has 2"),
    (
        "metrics.csv",
        "step,train_loss\n0,0.5\n1,abc\n",
        "line 3, column 'train_loss': 'abc' is not a number",
    ),
    ("metrics.csv", "step,train_loss\n0,0.5\nx,0.4\n", "line 3: step 'x' is not an integer"),
    (
        "metrics.csv",
        "epoch,step,val_loss\n0,1,0.5\n",
        "has no column training loss (train_loss, train_loss_step",
    ),
    ("metrics.csv", "epoch,step,train_loss\n0,1,\n", "has no values of 'train_loss'"),
    ("metrics.csv", 'step,train_loss\n0,"0.5\n', "not a valid CSV row"),
    (
        "trainer_state.json",
        '{"log_history": [',
        "is not valid JSON: Expecting value (line 1, column 18)",
    ),
    ("trainer_state.json", '{"global_step": 3}', "has no 'log_history' list"),
    ("trainer_state.json", "[1, 2]", "has no 'log_history' list"),
    (
        "trainer_state.json",
        '{"log_history": [{"loss": 1.0}, 7]}',
        "log_history entry 2 is a int, not an object",
    ),
    (
        "trainer_state.json",
        '{"log_history": [{"loss": [1.0]}]}',
        "log_history entry 1, 'loss': '[1.0]' is not a number",
    ),
    ("trainer_state.json", '{"log_history": [{"loss": true}]}', "'loss': 'True' is not a number"),
    (
        "trainer_state.json",
        '{"log_history": [{"loss": 1.0, "step": -2}]}',
        "step -2 is not a non-negative integer",
    ),
    (
        "trainer_state.json",
        '{"log_history": [{"eval_loss": 1.0}]}',
        "has no metric training loss (loss); it has: eval_loss",
    ),
    (
        "trainer_state.json",
        '{"log_history": []}',
        "has no metric training loss (loss); it has: none",
    ),
    ("trainer_state.json", "[" * 100000, "is not valid JSON"),
]


@pytest.mark.parametrize(("file_name", "content", "message"), MALFORMED)
def test_a_malformed_metrics_file_is_one_line_naming_the_file_and_exits_2(
    tmp_path, capsys, file_name, content, message
):
    path = tmp_path / file_name
    path.write_text(content)
    (tmp_path / "good.csv").write_text(LIGHTNING_CSV)

    assert cli.main(["compare", str(path), str(tmp_path / "good.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"detctx: error: {path}")
    assert message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--metric", "loss", "--pattern", "x=(\\S+)", "a.log", "a.log"], "not both"),
        (["compare", "--pattern", "x=(\\S+)", "good.csv", "good.csv"], "--pattern reads text logs"),
        (
            ["compare", "--metric", "nope", "good.csv", "good.csv"],
            "has no column 'nope'; it has: epoch",
        ),
        (["compare", ".", "good.csv"], "is a folder without trainer_state.json or metrics.csv"),
        (["compare", "missing.csv", "good.csv"], "no such log file"),
    ],
)
def test_bad_metric_choices_are_one_line_errors_that_exit_2(
    tmp_path, capsys, monkeypatch, argv, message
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.csv").write_text(LIGHTNING_CSV)
    (tmp_path / "a.log").write_text("loss: 0.5\n")

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("detctx: error: ") and message in err


def test_two_real_lightning_fits_with_csv_logger_compare_equal_and_a_reseeded_one_differs(
    tmp_path, capsys
):
    pl = pytest.importorskip("lightning.pytorch")
    torch = pytest.importorskip("torch")
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, index):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(name, seed):
        with detctx.deterministic(seed=seed):
            data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
            trainer = pl.Trainer(
                max_epochs=2,
                logger=CSVLogger(str(tmp_path), name=name),
                log_every_n_steps=1,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
                accelerator="cpu",
            )
            trainer.fit(
                Regression(),
                DataLoader(data, batch_size=8, shuffle=True),
                DataLoader(data, batch_size=8),
            )
            return trainer.logger.log_dir

    first, second, other = fit("a", 0), fit("b", 0), fit("c", 1)

    assert cli.main(["compare", first, f"{second}/metrics.csv"]) == 0
    assert "agree bit for bit on all 8 metric values" in capsys.readouterr().out
    assert cli.main(["compare", "--metric", "val_loss", first, second]) == 0
    capsys.readouterr()
    assert cli.main(["compare", first, other]) == 1
    out = capsys.readouterr().out
    assert "first divergence at point 1 of 8 (logged as step 0, line 2 of" in out


@pytest.mark.slow
def test_a_real_trainers_state_file_and_printed_lines_show_where_evaluation_moved_training(
    tmp_path, capsys
):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tiny_masked_lm import make_datasets, make_tokenizer, make_trainer

    tokenizer, datasets = make_tokenizer(tmp_path), make_datasets()
    for name, evaluate in (("quiet", False), ("evaluated", True)):
        capsys.readouterr()
        trainer = make_trainer(tokenizer, datasets, tmp_path / name, evaluate=evaluate)
        trainer.train()
        trainer.save_state()
        (tmp_path / f"{name}.log").write_text(capsys.readouterr().out)

    quiet, evaluated = str(tmp_path / "quiet"), str(tmp_path / "evaluated")
    assert cli.main(["compare", quiet, quiet]) == 0
    assert "agree bit for bit on all 8 metric values" in capsys.readouterr().out
    assert cli.main(["compare", quiet, evaluated]) == 1
    out = capsys.readouterr().out
    assert "first divergence at point 3 of 8 (logged as step 3, log_history entry 3 of" in out
    assert cli.main(["compare", str(tmp_path / "quiet.log"), str(tmp_path / "evaluated.log")]) == 1
    assert "first divergence at point 3" in capsys.readouterr().out


def test_names_from_a_crafted_file_cannot_break_the_one_line_error(tmp_path, capsys):
    (tmp_path / "a.csv").write_text('"\ufeffepoch\nstep",' + "x" * 300 + "\n1,2\n")
    (tmp_path / "b.csv").write_text(LIGHTNING_CSV)

    assert cli.main(["compare", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no column training loss" in err
    assert len(err) < 600


def test_a_csv_with_a_byte_order_mark_reads_its_first_column(tmp_path, capsys):
    (tmp_path / "a.csv").write_text("\ufeff" + LIGHTNING_CSV.replace("epoch,step,", "step,epoch,"))
    (tmp_path / "b.csv").write_text(LIGHTNING_CSV)

    assert (
        cli.main(["compare", "--metric", "step", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
        == 1
    )
    capsys.readouterr()
    assert cli.main(["compare", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 0
