"""One rank of the multi-process scenarios in ``test_distributed.py``.

Started by the test as ``python distributed_worker.py PORT WORLD_SIZE OUT_DIR [train]``:
forks one process per rank; each joins a gloo group on loopback through the
test's TCP store (with ``DETCTX_SEED=1000+rank``), runs every scenario once,
writes what it saw to ``OUT_DIR/rank<r>.json`` and leaves the group.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from helpers import draws, fork_ranks

import detctx
from detctx import (
    RankDivergenceError,
    SeedAgreementError,
    SeedMismatchError,
    distributed_deterministic,
)

# Short, so that the scenarios where ranks are missing finish in seconds; the ranks that do
# arrive meet at a store barrier first, so none of them is late by more than a moment, even
# on a loaded machine.
FAILURE_TIMEOUT_S = 3.0
BARRIER_TIMEOUT = timedelta(seconds=120)


def agreement(rank: int, world: int) -> dict[str, Any]:
    # The launcher gives each rank a different DETCTX_SEED: the source rank's wins.
    with distributed_deterministic(seed=None) as run:
        from_rank0 = [run.seed, draws()]
    with distributed_deterministic(seed=None, src=world - 1) as run:
        from_last = [run.seed, draws()]
    del os.environ["DETCTX_SEED"]
    with distributed_deterministic() as run:
        entropy = [run.seed, draws()]

    @distributed_deterministic()
    def decorated() -> list[float]:
        return draws()

    # Generators and coroutines agree on their world's seed on their first step.
    @distributed_deterministic()
    def generator() -> Iterator[list[float]]:
        yield draws()
        yield draws()

    @distributed_deterministic()
    async def coroutine() -> list[float]:
        await asyncio.sleep(0)
        return draws()

    return {
        "from_rank0": from_rank0,
        "from_last": from_last,
        "entropy": entropy,
        "decorated": decorated(),
        "generator": list(generator()),
        "coroutine": asyncio.run(coroutine()),
    }


def mismatches(rank: int, world: int) -> dict[str, Any]:
    before = detctx.fingerprint()
    seen = {}
    for name, kwargs in {
        "last_rank_differs": {"seed": 100 + (rank == world - 1)},
        "none_vs_explicit": {"seed": None if rank == 0 else 5},
        "per_rank_differs": {"seed": 5, "per_rank": rank == 1},
    }.items():
        try:
            with distributed_deterministic(**kwargs):
                seen[name] = "entered"
        except SeedMismatchError as exc:
            seen[name] = {"message": str(exc), "seeds": list(exc.seeds)}
    seen["state_untouched"] = detctx.fingerprint() == before
    return seen


def streams(rank: int, world: int) -> dict[str, Any]:
    with distributed_deterministic(seed=1234) as run:
        shared = draws()
        detctx.verify_across_ranks()
    with distributed_deterministic(seed=1234, per_rank=True) as run:
        per_rank = draws()
        # Each rank draws a different amount: per-rank states are not compared.
        torch.rand(rank + 1)
        detctx.verify_across_ranks()
    return {
        "shared": shared,
        "per_rank": per_rank,
        "per_rank_seed": run.seed,
        "expected_seed": detctx.derive_seed(1234, rank),
        "run": [run.shared_seed, run.rank, run.world_size],
    }


def divergence(rank: int, world: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with distributed_deterministic(seed=7):
        torch.rand(2)
        if rank == world - 1:
            torch.rand(1)  # one rank consumes extra randomness
        if rank == 1 and world > 2:
            np.random.rand()
        try:
            detctx.verify_across_ranks()
            seen["caught"] = None
        except RankDivergenceError as exc:
            seen["caught"] = {"divergent": exc.divergent, "message": str(exc)}
    before = detctx.fingerprint()
    try:
        with distributed_deterministic(seed=7, verify=True):
            if rank == 0:
                random.random()
        seen["on_exit"] = None
    except RankDivergenceError as exc:
        seen["on_exit"] = {"divergent": exc.divergent}
    seen["restored_after_exit_check"] = detctx.fingerprint() == before
    return seen


def wait_for(store: dist.Store, name: str, count: int) -> None:
    """Wait until the store's counter ``name`` reaches ``count``."""
    deadline = time.monotonic() + BARRIER_TIMEOUT.total_seconds()
    while store.add(f"barrier/{name}", 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: fewer than {count} ranks arrived")
        time.sleep(0.005)


def arrived_together(store: dist.Store, name: str, count: int) -> None:
    """Wait until ``count`` ranks have called this with ``name`` (a barrier over the store)."""
    store.add(f"barrier/{name}", 1)
    wait_for(store, name, count)


def failures(rank: int, world: int, store: dist.Store) -> dict[str, Any]:
    """Rank 1 raises inside a verify=True block; then the odd ranks never enter at all.

    Runs last: after a timeout, gloo closes the connections it timed out on,
    so the groups the missing ranks skipped are not used again.
    """
    seen: dict[str, Any] = {}
    before = detctx.fingerprint()
    try:
        with distributed_deterministic(seed=3, verify=True):
            if rank == 1:
                raise ValueError("a bad batch")
        seen["raised"] = None
    except ValueError:
        seen["raised"] = "its own ValueError"
    except SeedAgreementError as exc:
        seen["raised"] = {"message": str(exc), "failed": sorted(exc.failed.items())}
    seen["restored_after_raise"] = detctx.fingerprint() == before
    # Every rank creates the groups (a collective); then the odd ranks skip them.
    block_group = dist.new_group(backend="gloo")
    agree_group = dist.new_group(backend="gloo")
    arriving = (world + 1) // 2  # the even ranks
    if rank % 2:
        # Stay alive until the others timed out: a rank stuck elsewhere, not a crash.
        wait_for(store, "failures done", arriving)
        return seen

    def enter_block() -> None:
        with distributed_deterministic(seed=3, group=block_group, timeout=FAILURE_TIMEOUT_S):
            pass

    def agree() -> None:
        detctx.agree_seed(3, group=agree_group, timeout=FAILURE_TIMEOUT_S)

    for name, attempt in {"block": enter_block, "agree_seed": agree}.items():
        arrived_together(store, name, arriving)
        try:
            attempt()
            seen[name] = "entered"
        except SeedAgreementError as exc:
            seen[name] = {"message": str(exc), "missing": list(exc.missing or ())}
    seen["restored_after_timeout"] = detctx.fingerprint() == before
    store.add("barrier/failures done", 1)
    return seen


def train(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    with distributed_deterministic(seed=2024, per_rank=True):
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.25),
            torch.nn.Linear(16, 1),
        )
        ddp = DistributedDataParallel(model)
        optimiser = torch.optim.SGD(ddp.parameters(), lr=0.05)
        losses = []
        for _ in range(6):
            x = torch.randn(16, 8)
            y = x.sum(dim=1, keepdim=True)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item().hex())
        with torch.no_grad():
            weights = float(sum(p.double().sum() for p in model.parameters())).hex()
    return {"losses": losses, "weights": weights}


def run_rank(rank: int, world: int, port: int, out_dir: str, train_too: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), DETCTX_SEED=str(1000 + rank))
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    result = {
        "agreement": agreement(rank, world),
        "mismatches": mismatches(rank, world),
        "streams": streams(rank, world),
        "divergence": divergence(rank, world),
    }
    if train_too:
        result["train"] = train(rank, world)
    result["failures"] = failures(rank, world, store)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # No destroy_process_group: torch 2.1's waits forever for the collectives the failure
    # scenarios leave unanswered (a rank that never arrived); newer torch aborts them. The
    # forked rank ends with os._exit right after this, which closes its connections.


def main() -> None:
    port, world, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    train_too = "train" in sys.argv[4:]
    fork_ranks(run_rank, world, world, port, out_dir, train_too)


if __name__ == "__main__":
    main()
