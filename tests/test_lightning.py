"""DeterministicCallback with the real Lightning Trainer on CPU, compared bit for bit."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from conftest import TESTS
from helpers import mindspeed_seed
from lightning_fit import SEED, build_model, framework, trainer, weights

import detctx
from detctx.integrations import lightning as integration
from detctx.integrations.lightning import DeterministicCallback

FIT_TIMEOUT_S = 600


@pytest.fixture(autouse=True)
def _no_lightning_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """seed_everything exports these; each test starts without them and gets them back."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)


def fit(callback: Any = None, *, workers: int = 0, random_val: bool = True, **options: Any) -> Any:
    model = build_model(random_val=random_val, workers=workers, val_generator=not random_val)
    callbacks = [] if callback is None else [callback]
    trainer(callbacks=callbacks, **options).fit(model)
    return model


def run_fit_script(out: Path, *args: str) -> dict[str, Any]:
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
    proc = subprocess.run(
        [sys.executable, str(TESTS / "lightning_fit.py"), str(out), *args],
        capture_output=True,
        text=True,
        timeout=FIT_TIMEOUT_S,
        env=env,
    )
    if proc.returncode != 0:
        pytest.fail(f"fit exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_the_training_curve_is_the_same_whether_validation_runs_every_epoch_every_2_steps_or_never(
    workers: int,
) -> None:
    every_epoch = fit(DeterministicCallback(seed=SEED), workers=workers)
    every_2_steps = fit(DeterministicCallback(seed=SEED), workers=workers, val_check_interval=2)
    never = fit(DeterministicCallback(seed=SEED), workers=workers, limit_val_batches=0)

    assert len(every_epoch.losses) == 8
    assert every_epoch.losses == every_2_steps.losses == never.losses
    assert weights(every_epoch) == weights(every_2_steps) == weights(never)


def test_without_the_callback_a_validation_that_draws_changes_the_training_curve() -> None:
    with detctx.deterministic(seed=SEED):
        every_epoch = fit()
    with detctx.deterministic(seed=SEED):
        never = fit(limit_val_batches=0)

    assert every_epoch.losses[:4] == never.losses[:4]
    assert every_epoch.losses[4:] != never.losses[4:]


def test_every_validation_run_starts_from_eval_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    noise: list[float] = []
    body = build_model().__class__.validation_step

    def validation_step(self: Any, batch: Any, index: int) -> Any:
        noise.append(float(torch.rand(())))
        return body(self, batch, index)

    monkeypatch.setattr(build_model().__class__, "validation_step", validation_step)
    fit(DeterministicCallback(seed=SEED, eval_seed=3))

    # The sanity check's 2 batches, then 2 epochs of 2 validation batches.
    assert len(noise) == 6
    assert noise[0:2] == noise[2:4] == noise[4:6]
    fit(DeterministicCallback(seed=SEED + 1, eval_seed=4))
    assert noise[6:8] != noise[0:2]


def test_a_fit_under_the_callback_equals_seed_everything_and_a_deterministic_trainer() -> None:
    reference_model = build_model(random_val=False, val_generator=True)
    framework().seed_everything(SEED)
    trainer(deterministic=True).fit(reference_model)
    os.environ.pop("PL_GLOBAL_SEED")

    model = fit(DeterministicCallback(seed=SEED), random_val=False)

    assert model.losses == reference_model.losses
    assert weights(model) == weights(reference_model)


@pytest.mark.slow
@pytest.mark.usefixtures("one_launch_at_a_time")
def test_with_ddp_spawn_on_2_processes_the_callback_equals_seed_everything(tmp_path: Path) -> None:
    reference, ours = tmp_path / "reference", tmp_path / "ours"
    reference.mkdir()
    ours.mkdir()
    spawn = ("--strategy", "ddp_spawn", "--devices", "2")
    expected = run_fit_script(
        reference / "out.json", "--reference", *spawn, "--record-to", str(reference)
    )
    got = run_fit_script(ours / "out.json", *spawn, "--record-to", str(ours))

    assert got["weights"] == expected["weights"]
    for rank in (0, 1):
        curve = json.loads((ours / f"losses-{rank}.json").read_text())
        assert len(curve) == 4
        assert curve == json.loads((reference / f"losses-{rank}.json").read_text())


@pytest.mark.slow
def test_a_run_resumed_in_a_fresh_process_from_an_epoch_checkpoint_continues_bit_for_bit(
    tmp_path: Path,
) -> None:
    checkpoints = framework().callbacks.ModelCheckpoint(
        dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}"
    )
    straight = build_model()
    trainer(
        callbacks=[DeterministicCallback(seed=SEED), checkpoints], enable_checkpointing=True
    ).fit(straight)

    resumed = run_fit_script(
        tmp_path / "resumed.json", "--random-val", "--resume", str(tmp_path / "epoch=0.ckpt")
    )

    assert len(straight.losses) == 8
    assert resumed["losses"] == straight.losses[4:]
    assert resumed["weights"] == weights(straight)


def saved_rng(tmp_path: Path, in_validation: bool) -> tuple[str, bool]:
    """The RNG fingerprint in the epoch-0 checkpoint, and whether it was saved while validating."""
    pl = framework()
    where: list[bool] = []

    class WhereSaved(pl.Callback):  # type: ignore[misc,name-defined]
        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: Any) -> None:
            where.append(trainer.validating)

    folder = tmp_path / str(in_validation)
    checkpoints = pl.callbacks.ModelCheckpoint(
        dirpath=folder, filename="{epoch}", save_on_train_epoch_end=not in_validation
    )
    callbacks = [DeterministicCallback(seed=SEED), checkpoints, WhereSaved()]
    trainer(max_epochs=1, callbacks=callbacks, enable_checkpointing=True).fit(build_model())
    saved = torch.load(folder / "epoch=0.ckpt", weights_only=True)
    (state,) = [rank["rng"] for rank in saved["callbacks"]["detctx.DeterministicCallback"]["ranks"]]
    return detctx.Snapshot.from_state_dict(state).fingerprint(), where[0]


def test_a_checkpoint_saved_during_validation_holds_the_training_streams(tmp_path: Path) -> None:
    at_epoch_end, validating = saved_rng(tmp_path, in_validation=False)
    assert not validating
    in_validation, validating = saved_rng(tmp_path, in_validation=True)
    assert validating

    assert in_validation == at_epoch_end


def test_after_a_fit_every_rng_flag_and_lightning_variable_is_as_before() -> None:
    os.environ["PL_GLOBAL_SEED"] = "99"
    mindspeed_seed(1)
    before = detctx.fingerprint()

    fit(DeterministicCallback(seed=SEED))

    assert detctx.fingerprint() == before
    assert os.environ["PL_GLOBAL_SEED"] == "99"
    assert "PL_SEED_WORKERS" not in os.environ
    assert not torch.are_deterministic_algorithms_enabled()
    assert detctx.open_blocks() == ()


def test_test_and_predict_repeat_run_to_run_and_leave_every_rng_as_before() -> None:
    model = build_model()
    loader = model.val_dataloader()
    before = detctx.fingerprint()

    tested = [
        trainer(callbacks=[DeterministicCallback(eval_seed=2)]).test(model, loader, verbose=False)
        for _ in range(2)
    ]
    predicted = [
        trainer(callbacks=[DeterministicCallback(eval_seed=2)]).predict(model, loader)
        for _ in range(2)
    ]

    assert tested[0] == tested[1]
    assert all(torch.equal(a, b) for a, b in zip(predicted[0], predicted[1]))
    assert detctx.fingerprint() == before
    assert "PL_GLOBAL_SEED" not in os.environ


def test_a_fit_that_raises_still_puts_everything_back(monkeypatch: pytest.MonkeyPatch) -> None:
    before = detctx.fingerprint()

    def training_step(self: Any, batch: Any, index: int) -> Any:
        torch.rand(3)
        raise ValueError("boom")

    monkeypatch.setattr(build_model().__class__, "training_step", training_step)
    with pytest.raises(ValueError, match="boom"):
        fit(DeterministicCallback(seed=SEED))

    assert detctx.fingerprint() == before
    assert "PL_GLOBAL_SEED" not in os.environ
    assert detctx.open_blocks() == ()


def test_a_crafted_checkpoint_state_is_refused_before_any_rng_changes() -> None:
    callback = DeterministicCallback(seed=SEED)
    good = callback.state_dict()
    before = detctx.fingerprint()
    crafted = [
        "not a dict",
        {**good, "format": "something else"},
        {**good, "version": 99},
        {key: value for key, value in good.items() if key != "rng"},
        {**good, "rng": {**good["rng"], "sources": {"torch": "garbage"}}},
    ]
    by_rank = {key: value for key, value in good.items() if key != "rng"}
    crafted += [
        {**by_rank, "ranks": []},
        {**by_rank, "ranks": "rank 0"},
        {**by_rank, "ranks": [{"loaders": None}]},
        {**by_rank, "ranks": [{"rng": good["rng"], "loaders": "not a list"}]},
        # Saved by 2 processes, resumed by this one.
        {**by_rank, "ranks": [{"rng": good["rng"], "loaders": None}] * 2},
    ]
    for state in crafted:
        with pytest.raises(detctx.CheckpointError):
            callback.load_state_dict(state)
        assert detctx.fingerprint() == before
    # The seeds it was saved with are seeds: a tensor there was compared elementwise (torch's
    # RuntimeError), anything else was shown in a warning and the state taken.
    for name, value in [
        ("seed", torch.zeros(3)),
        ("seed", torch.tensor(7)),
        ("seed", 2**70),
        ("seed", -1),
        ("eval_seed", "key"),
        ("eval_seed", 1.5),
        ("eval_seed", True),
        ("eval_seed", [1, 2]),
        ("seed", None),  # every version saves both
    ]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(detctx.CheckpointError, match=f"entry has {name} "):
                callback.load_state_dict({**good, name: value})
        assert detctx.fingerprint() == before


def test_resuming_from_a_checkpoint_without_detctx_state_warns(tmp_path: Path) -> None:
    model = build_model()
    plain = trainer(max_epochs=1, enable_checkpointing=False)
    plain.fit(model)
    plain.save_checkpoint(tmp_path / "plain.ckpt")

    with pytest.warns(detctx.DeterminismWarning, match="holds no detctx RNG state") as caught:
        trainer(callbacks=[DeterministicCallback(seed=SEED)]).fit(
            build_model(), ckpt_path=tmp_path / "plain.ckpt"
        )

    # At the user's fit(...) line, past Lightning's frames.
    assert {w.filename for w in caught if "holds no detctx" in str(w.message)} == {__file__}


def test_bad_seeds_are_refused_when_the_callback_is_built() -> None:
    with pytest.raises(ValueError, match="seed"):
        DeterministicCallback(seed=-1)
    with pytest.raises(ValueError, match="eval_seed"):
        DeterministicCallback(eval_seed=2**32)
    with pytest.raises(ValueError, match="algorithms"):
        DeterministicCallback(seed=SEED, algorithms="sometimes")  # type: ignore[typeddict-item]


def test_the_callback_is_a_callback_of_the_lightning_package_in_use() -> None:
    assert isinstance(DeterministicCallback(), framework().Callback)


def test_it_works_with_a_pytorch_lightning_trainer_too() -> None:
    pytest.importorskip("pytorch_lightning")
    callback = integration.callback_class("pytorch_lightning")(seed=SEED)
    assert isinstance(callback, framework("pytorch_lightning").Callback)

    model = build_model("pytorch_lightning")
    trainer("pytorch_lightning", callbacks=[callback]).fit(model)
    same = fit(DeterministicCallback(seed=SEED))

    assert model.losses == same.losses


def test_without_lightning_installed_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(detctx.MissingDependencyError, match=r"detctx\[lightning\]"):
        integration.callback_class()
