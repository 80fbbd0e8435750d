"""DeterministicCallback on every rank's loader workers, and on machines whose fits wake a device.

Loader workers: under the callback, Lightning's own ``pl_worker_init_function``
seeds each worker of each rank, so the seeds are those of
``seed_everything(seed, workers=True)``. Devices: Lightning's sanity check runs
in ``isolate_rng``, which reads and writes every CUDA state (waking CUDA); the
fit must still leave every RNG, flag and variable as it was. On a CPU machine
the simulated NPU stands in for CUDA (isolate_rng made to read and write it as
it does CUDA); the CUDA tests run where a CUDA device is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning.pytorch")

from conftest import HIDE_CUDA, ROOT, TESTS, run_python
from lightning_fit import SEED, framework, trainer
from lightning_worker_seeds import Model

import detctx
from detctx.integrations.lightning import DeterministicCallback

pytestmark = pytest.mark.usefixtures("one_launch_at_a_time")

FIT_TIMEOUT_S = 600


@pytest.fixture(autouse=True)
def _no_lightning_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)


def worker_seeds(out: Path, *options: str) -> dict[str, dict[str, str]]:
    """``{rank: {worker: torch seed}}`` from ``tests/lightning_worker_seeds.py`` run with
    ``options``."""
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(TESTS / "lightning_worker_seeds.py"), str(out), *options],
        capture_output=True,
        text=True,
        timeout=FIT_TIMEOUT_S,
        env=env,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        pytest.fail(f"fit exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return {path.stem[6:]: json.loads(path.read_text()) for path in out.glob("seeds-*.json")}


def every_seed(by_rank: dict[str, dict[str, str]]) -> list[str]:
    return [seed for workers in by_rank.values() for seed in workers.values()]


@pytest.mark.slow
def test_under_ddp_spawn_each_ranks_workers_get_the_seeds_of_seed_everything_workers_true(
    tmp_path: Path,
) -> None:
    spawn = ("--strategy", "ddp_spawn", "--devices", "2")
    expected = worker_seeds(tmp_path / "reference", "--reference", *spawn)
    got = worker_seeds(tmp_path / "callback", *spawn)

    assert sorted(got) == ["0", "1"] and all(len(workers) == 2 for workers in got.values())
    assert got == expected
    assert len(set(every_seed(got))) == 4


@pytest.mark.slow
def test_under_ddp_spawn_a_detctx_loader_gives_each_rank_and_worker_its_own_seeds(
    tmp_path: Path,
) -> None:
    got = worker_seeds(
        tmp_path / "callback", "--detctx-loader", "--strategy", "ddp_spawn", "--devices", "2"
    )

    assert sorted(got) == ["0", "1"] and all(len(workers) == 2 for workers in got.values())
    assert len(set(every_seed(got))) == 4


def fit_in_process(tmp_path: Path, *, reference: bool = False, **options: Any) -> dict[int, str]:
    model = Model(str(tmp_path), detctx_loader=False)
    if reference:
        framework().seed_everything(SEED, workers=True)
    trainer(max_epochs=1, **options).fit(model)
    return model.seeds


def test_in_one_process_the_workers_get_the_seeds_of_seed_everything_workers_true(
    tmp_path: Path,
) -> None:
    expected = fit_in_process(tmp_path, reference=True)
    os.environ.pop("PL_GLOBAL_SEED")
    os.environ.pop("PL_SEED_WORKERS")

    got = fit_in_process(tmp_path, callbacks=[DeterministicCallback(seed=SEED)])

    assert got == expected and len(set(got.values())) == 2
    assert "PL_SEED_WORKERS" not in os.environ


class ReseedsInSetup(Model):  # type: ignore[misc]
    def setup(self, stage: str) -> None:
        framework().seed_everything(99)


def test_seed_everything_in_the_modules_setup_is_warned_about(tmp_path: Path) -> None:
    model = ReseedsInSetup(str(tmp_path), detctx_loader=False)
    with pytest.warns(detctx.DeterminismWarning, match="changed from 7 to 99"):
        trainer(max_epochs=1, callbacks=[DeterministicCallback(seed=SEED)]).fit(model)


def test_a_fit_that_keeps_the_callbacks_seed_is_not_warned_about(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", detctx.DeterminismWarning)
        fit_in_process(tmp_path, callbacks=[DeterministicCallback(seed=SEED)])


# A fit whose sanity check wakes a device and reads and writes its states.
FIT_LEAVES_EVERYTHING = """
import os, random, sys
import numpy as np
import torch, detctx
from lightning_fit import SEED, build_model, trainer
from detctx.integrations.lightning import DeterministicCallback

device, state, outcome = sys.argv[1:]
if device == "npu":
    import simulated_npu as sim
    import lightning.pytorch.utilities.seed as pl_seed
    sim.install(2)
    collect, put_back = pl_seed._collect_rng_states, pl_seed._set_rng_states

    def collect_with_npu(include_cuda=True):  # isolate_rng, as it treats CUDA
        return {**collect(include_cuda), "npu": torch.npu.get_rng_state_all()}

    def put_back_with_npu(states, *args):
        torch.npu.set_rng_state_all(states.pop("npu"))
        put_back(states, *args)

    pl_seed._collect_rng_states, pl_seed._set_rng_states = collect_with_npu, put_back_with_npu
module = torch.npu if device == "npu" else torch.cuda
if state == "warm":
    module.get_rng_state()
os.environ["PL_GLOBAL_SEED"] = "99"
random.seed(1)
np.random.seed(1)
torch.manual_seed(1)
before = detctx.capture()
switches = detctx.Snapshot.capture(switches=True).switches

model = build_model()
if outcome == "raises":
    def training_step(self, batch, index):
        torch.rand(3)
        raise ValueError("boom")
    type(model).training_step = training_step
try:
    trainer(callbacks=[DeterministicCallback(seed=SEED)]).fit(model)
except ValueError:
    assert outcome == "raises"

assert module.is_initialized()                   # the sanity check woke the device
after = detctx.capture()
assert after == before, (before.source_fingerprints(), after.source_fingerprints())
assert detctx.Snapshot.capture(switches=True).switches == switches
assert os.environ["PL_GLOBAL_SEED"] == "99" and "PL_SEED_WORKERS" not in os.environ
assert detctx.open_blocks() == ()
print("ok")
"""


def fit_leaves_everything(device: str, state: str, outcome: str) -> str:
    env = HIDE_CUDA if device == "npu" else {}
    script = FIT_LEAVES_EVERYTHING.replace("sys.argv[1:]", repr([device, state, outcome]))
    return run_python(script, env=env, timeout=FIT_TIMEOUT_S).strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("state", "outcome"), [("cold", "fits"), ("warm", "fits"), ("cold", "raises")]
)
def test_a_fit_whose_sanity_check_wakes_the_npu_leaves_everything_as_before(
    state: str, outcome: str
) -> None:
    assert fit_leaves_everything("npu", state, outcome) == "ok"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("state", "outcome"),
    [("cold", "fits"), ("warm", "fits"), ("cold", "raises"), ("warm", "raises")],
)
def test_a_cpu_fit_on_a_cuda_machine_leaves_everything_as_before(state: str, outcome: str) -> None:
    assert fit_leaves_everything("cuda", state, outcome) == "ok"
