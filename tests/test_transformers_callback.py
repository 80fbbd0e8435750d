"""The Hugging Face Trainer with DeterministicCallback: evaluation no longer moves training.

The training is tests/tiny_masked_lm.py's: a tiny BertForMaskedLM whose
random masking (DataCollatorForLanguageModeling) draws from torch's global
generator in training and in evaluation alike.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import detctx

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tiny_masked_lm import make_datasets, make_tokenizer, make_trainer  # noqa: E402

from detctx.integrations.transformers import DeterministicCallback  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def datasets():
    return make_datasets()


def train_masked_lm(tokenizer, datasets, tmp_path, *, evaluate, callbacks=(), **arguments):
    """Train; the logged training and eval losses, and torch's state after."""
    output = tmp_path / f"out-{evaluate}-{len(callbacks)}"
    trainer = make_trainer(
        tokenizer, datasets, output, evaluate=evaluate, callbacks=callbacks, **arguments
    )
    trainer.train()
    history = trainer.state.log_history
    return (
        [entry["loss"] for entry in history if "loss" in entry],
        [entry["eval_loss"] for entry in history if "eval_loss" in entry],
        torch.get_rng_state(),
    )


@pytest.mark.slow
def test_training_losses_are_the_same_bit_for_bit_with_evaluation_every_2_steps_or_none(
    tokenizer, datasets, tmp_path
):
    quiet, quiet_eval, quiet_state = train_masked_lm(
        tokenizer, datasets, tmp_path, evaluate=False, callbacks=[DeterministicCallback()]
    )
    evaluated, eval_losses, evaluated_state = train_masked_lm(
        tokenizer, datasets, tmp_path, evaluate=True, callbacks=[DeterministicCallback()]
    )
    assert quiet_eval == [] and len(eval_losses) == 4
    assert len(quiet) == 8
    assert evaluated == quiet
    assert torch.equal(evaluated_state, quiet_state)
    assert detctx.open_blocks() == ()


@pytest.mark.slow
def test_evaluating_at_the_start_and_after_each_epoch_changes_no_training_loss_either(
    tokenizer, datasets, tmp_path
):
    quiet, _, _ = train_masked_lm(
        tokenizer, datasets, tmp_path, evaluate=False, callbacks=[DeterministicCallback()], steps=16
    )
    evaluated, eval_losses, _ = train_masked_lm(
        tokenizer,
        datasets,
        tmp_path,
        evaluate=True,
        callbacks=[DeterministicCallback()],
        steps=16,
        eval_strategy="epoch",
        eval_on_start=True,
    )
    assert len(eval_losses) == 3
    assert len(quiet) == 16
    assert evaluated == quiet
    assert detctx.open_blocks() == ()


@pytest.mark.slow
def test_with_two_loader_workers_evaluation_changes_no_training_loss_either(
    tokenizer, datasets, tmp_path
):
    def run(evaluate):
        return train_masked_lm(
            tokenizer,
            datasets,
            tmp_path,
            evaluate=evaluate,
            callbacks=[DeterministicCallback()],
            dataloader_num_workers=2,
        )

    quiet, _, _ = run(False)
    evaluated, eval_losses, _ = run(True)
    assert len(eval_losses) == 4
    assert evaluated == quiet


@pytest.mark.slow
def test_without_the_callback_evaluation_changes_the_training_losses(tokenizer, datasets, tmp_path):
    quiet, _, _ = train_masked_lm(tokenizer, datasets, tmp_path, evaluate=False)
    evaluated, _, _ = train_masked_lm(tokenizer, datasets, tmp_path, evaluate=True)
    assert evaluated[:2] == quiet[:2]
    assert evaluated[2:] != quiet[2:]


@pytest.mark.slow
def test_eval_losses_repeat_run_to_run_and_do_not_depend_on_the_callers_stream(
    tokenizer, datasets, tmp_path
):
    _, first, _ = train_masked_lm(
        tokenizer, datasets, tmp_path, evaluate=True, callbacks=[DeterministicCallback(eval_seed=3)]
    )
    torch.rand(5)  # the caller's stream has moved; the eval losses must not
    _, second, _ = train_masked_lm(
        tokenizer, datasets, tmp_path, evaluate=True, callbacks=[DeterministicCallback(eval_seed=3)]
    )
    assert len(first) == 4
    assert first == second


def test_each_evaluation_starts_from_the_eval_seed_with_determinism_on():
    callback = DeterministicCallback(eval_seed=11)
    args = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    control = transformers.TrainerControl(should_evaluate=True)
    state = transformers.TrainerState()
    torch.manual_seed(99)
    before = torch.get_rng_state()
    callback.on_step_end(args, state, control)
    inside = detctx.open_blocks()
    switched_on = torch.are_deterministic_algorithms_enabled()
    drawn = torch.rand(3)
    callback.on_evaluate(args, state, control, metrics={})
    assert [seeding.seed for seeding in inside] == [11]
    assert switched_on
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(11)))
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.are_deterministic_algorithms_enabled()
    assert detctx.open_blocks() == ()


def test_an_evaluation_that_raised_is_closed_by_the_next_train_or_close():
    callback = DeterministicCallback(eval_seed=1)
    args = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    state = transformers.TrainerState()
    before = torch.get_rng_state()
    callback.on_step_end(args, state, transformers.TrainerControl(should_evaluate=True))
    torch.rand(4)  # the evaluation draws, then raises: no on_evaluate
    assert len(detctx.open_blocks()) == 1
    callback.on_train_begin(args, state, transformers.TrainerControl())
    assert detctx.open_blocks() == ()
    assert torch.equal(torch.get_rng_state(), before)
    callback.close()  # nothing open: nothing to do
    assert detctx.open_blocks() == ()


def test_a_direct_predict_outside_any_block_warns_how_to_scope_it(tokenizer, datasets):
    callback = DeterministicCallback(eval_seed=4)
    args = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    with pytest.warns(detctx.DeterminismWarning, match=r"detctx.deterministic\(seed=4\)"):
        callback.on_predict(args, state, control, metrics={})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with detctx.deterministic(seed=4):
            callback.on_predict(args, state, control, metrics={})
            callback.on_evaluate(args, state, control, metrics={})


@pytest.mark.parametrize(
    ("arguments", "error"),
    [({"eval_seed": -1}, ValueError), ({"eval_seed": "0"}, TypeError), ({"cudnn": 1}, TypeError)],
)
def test_a_bad_eval_seed_or_switch_fails_when_the_callback_is_built(arguments, error):
    with pytest.raises(error):
        DeterministicCallback(**arguments)


@pytest.mark.slow
def test_without_transformers_the_import_error_names_the_extra_to_install():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n"
        "    import detctx.integrations.transformers\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.startswith("MissingDependencyError")
    assert "pip install 'detctx[transformers]'" in out
