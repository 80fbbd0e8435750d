"""Test fixtures: a clean process-global state per test, and subprocess runs (plain
helpers that child scripts import too are in ``helpers.py``)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import DETERMINISM_ENV
from hypothesis import settings

import detctx
from detctx._basics import reset_caches
from detctx._state import interrupts

# CI replays the same examples on every run (.ci/run sets CI=true), so
# that a landing never depends on which examples a random draw explored; locally,
# hypothesis explores fresh examples each run and keeps the failures it finds.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true"):
    settings.load_profile("ci")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

HIDE_CUDA = {"CUDA_VISIBLE_DEVICES": ""}
"""``run_python(..., env=HIDE_CUDA)``: a child that must see no CUDA device (the simulated
NPU as the only accelerator; CUDA's own lazy seeding would add to what a test counts)."""


@pytest.fixture(autouse=True)
def _isolated_globals() -> Iterator[None]:
    """Each test starts from, and leaves behind, the same global flags, env and caches.

    The caches are emptied on both sides: a test that patches a backend
    (``torch.cuda.is_initialized``) must not leave device sources built on the
    patch to the tests that follow it, in whatever order they run.
    """
    reset_caches()
    # Lightning's trainer puts back, after fit, the SIGINT handler it found when fit started.
    saved_sigint = signal.getsignal(signal.SIGINT)
    saved_env = {name: os.environ.get(name) for name in DETERMINISM_ENV}
    for name in DETERMINISM_ENV:
        os.environ.pop(name, None)
    saved_flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(saved_flags[0], warn_only=saved_flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved_flags[2:]
    for name, value in saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    signal.signal(signal.SIGINT, saved_sigint)
    # Nothing the test opened stays counted as open once every block is closed (parked
    # blocks of suspended generators are not in force, and not counted): a count left above
    # zero would keep detctx's signal handler in place for good.
    leaked = interrupts._open if interrupts._depth == 0 and not detctx.open_blocks() else 0
    if leaked:
        interrupts._open = 0
        interrupts._uninstall()
    assert not leaked, f"the test left {leaked} section(s) counted as open with no block open"
    # After every fixture of the test is undone (this autouse fixture is torn down last).
    reset_caches()


def run_python(
    code: str,
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    path: tuple[str, ...] = (),
) -> str:
    """Run ``code`` with ``args`` in a fresh interpreter, ``path`` and ``tests/`` importable.

    Returns its stdout; fails the test with the child's output if it exits non-zero.
    """
    child_env = dict(os.environ)
    if env:
        child_env.update(env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [*path, str(TESTS), str(ROOT), child_env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"child exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc.stdout


class CounterSource:
    """A user-defined RNG source whose state is one int: subclass it to make it misbehave."""

    def __init__(self) -> None:
        self.value = 0

    def capture(self) -> int:
        return self.value

    def restore(self, state: int) -> None:
        self.value = state

    def seed(self, seed: int) -> None:
        self.value = seed


def launch_ranks(script: Path, world_size: int, *options: str, timeout: float) -> list[Any]:
    """Run ``script PORT WORLD_SIZE OUT_DIR *options`` (it forks one process per rank);
    each rank's ``OUT_DIR/rank<r>.json``, by rank.

    The TCP store lives here, on a port the OS picks, so concurrent launches
    cannot collide; every rank is killed if the launch outlives ``timeout``.
    """
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out_dir:
        launcher = subprocess.Popen(
            [sys.executable, str(script), str(store.port), str(world_size), out_dir, *options],
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = launcher.communicate(timeout=timeout)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        assert launcher.returncode == 0, f"a rank failed:\n{output}"
        return [
            json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(world_size)
        ]


@pytest.fixture
def one_launch_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One multi-process launch that finds a free port and binds it later at a time.

    torchrun --standalone and Lightning's ddp_spawn pick a free port, release it and
    bind it again a moment later; two such launches at once on pytest-xdist's workers
    met EADDRINUSE (a shuffled run: Lightning's ddp_spawn and an elastic torchrun, in
    the same second). The lock file sits in the folder every worker's temp dir shares.
    """
    lock = tmp_path_factory.getbasetemp().parent / "one-launch-at-a-time.lock"
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone (a ``DeviceMesh`` needs one), taken down after."""
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread, put back after: recording runs many small ops, and on a
    loaded machine their threads wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _step_post_hooks_run() -> bool:
    """Whether torch's global optimizer step post-hooks, which count a window's steps, run in
    this process: in torch 2.1, once anything was compiled, TorchDynamo replaces
    ``Optimizer.step`` and they no longer do (docs/proving.md says so; another test of this
    process may have compiled)."""
    from torch.optim import optimizer

    ran: list[bool] = []
    handle = optimizer.register_optimizer_step_post_hook(lambda *_: ran.append(True))
    try:
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()
    finally:
        handle.remove()
    return bool(ran)


@pytest.fixture
def steps_counted() -> None:
    """Skips a test of a window of steps where the step hooks that count steps do not run."""
    if not _step_post_hooks_run():
        pytest.skip("torch's global optimizer step hooks do not run in this process")
