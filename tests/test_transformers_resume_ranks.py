"""The Hugging Face Trainer's 2-process row of the resume matrix: each process resumes its own
rank from a mid-epoch checkpoint, bit for bit; another world size is refused.

Two ranks on gloo, launched as ``torchrun`` would (``RANK``, ``WORLD_SIZE`` and the rendezvous
in the environment), each running ``tests/transformers_resume.py``: the straight runs in one
launch, the resumed ones in another, every worker setting a training in each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TESTS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_launch_at_a_time")]

pytest.importorskip("transformers")

RUN_TIMEOUT_S = 900
WORKERS = ("0", "2", "2p")


def train_ranks(folder: Path, run: str, *cases: str, world: int = 2) -> None:
    """``transformers_resume.py FOLDER RUN CASES`` in ``world`` processes, one per rank."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    path = os.pathsep.join([str(ROOT), str(TESTS)])
    base = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    launched = []
    for rank in range(world):
        # The ranks join the store above as clients, as under torchrun's agent.
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        env.update(
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT="0",
        )
        command = [sys.executable, "-W", "ignore", str(TESTS / "transformers_resume.py")]
        launched.append(
            subprocess.Popen(
                [*command, str(folder), run, *cases],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    outputs = []
    try:
        for process in launched:
            outputs.append(process.communicate(timeout=RUN_TIMEOUT_S)[0])
    finally:
        for process in launched:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    for process, output in zip(launched, outputs):
        assert process.returncode == 0, f"a rank failed:\n{output[-4000:]}"


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The straight 2-process trainings, checkpointing every 5 steps, one per worker setting."""
    folder = tmp_path_factory.mktemp("ranks")
    train_ranks(folder, "straight", *WORKERS)
    return folder


def test_two_trainer_processes_resumed_mid_epoch_continue_bit_for_bit_on_each_rank(
    straight_runs: Path,
) -> None:
    # 4 steps per epoch (8 samples a step across the ranks), evaluation every 2 steps on
    # sharded eval data, checkpoint-10 in the middle of the third epoch, 20 steps in all.
    tmp_path = straight_runs
    train_ranks(tmp_path, "resumed", *WORKERS)
    for workers in WORKERS:
        for rank in (0, 1):
            straight = torch.load(tmp_path / workers / f"straight-{rank}.pt")
            resumed = torch.load(tmp_path / workers / f"resumed-{rank}.pt")
            assert sorted(straight["train"]) == list(range(1, 21))
            assert (straight["steps_here"], resumed["steps_here"]) == (20, 10)
            assert resumed["train"] == straight["train"], (workers, rank)
            assert resumed["eval"] == straight["eval"], (workers, rank)
            pairs = zip(straight["weights"], resumed["weights"])
            assert all(torch.equal(a, b) for a, b in pairs), (workers, rank)


def test_a_two_process_checkpoint_resumed_by_one_process_is_refused_with_nothing_changed(
    straight_runs: Path,
) -> None:
    train_ranks(straight_runs, "resumed", "2@2", world=1)

    refusal = torch.load(straight_runs / "2@2" / "refused-0.pt")
    assert "world size 2" in refusal["refused"] and "resumed by 1" in refusal["refused"]
    assert refusal["unchanged"]
    assert not (straight_runs / "2@2" / "resumed-0.pt").exists()
