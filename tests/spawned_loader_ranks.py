"""Loader workers under plain ``torch.multiprocessing.spawn``, for ``test_data.py``.

``python tests/spawned_loader_ranks.py OUT.json``: two ranks join a gloo group
through a file store (``spawn`` sets no ``$RANK``); each reads two epochs, each
in its own ``distributed_deterministic(seed=3)`` block, through a DataLoader
with ``detctx.loader_generator()`` and ``detctx.seed_worker`` whose two workers
are started with ``spawn`` too, so they see neither a process group nor a rank
variable. Every item reports its worker, that worker's torch seed and one draw
of each RNG there. Writes ``{rank: [epoch 1 items, epoch 2 items]}``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset

import detctx

WORLD = 2


class WorkerDraws(Dataset[tuple[int, str, float, float, float, bool]]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[int, str, float, float, float, bool]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        sees_rank = dist.is_initialized() or "RANK" in os.environ
        draws = random.random(), float(np.random.rand()), torch.rand(1).item()
        return info.id, str(torch.initial_seed()), *draws, sees_rank


def epoch() -> list[list[Any]]:
    with detctx.distributed_deterministic(seed=3):
        loader = DataLoader(
            WorkerDraws(),
            batch_size=None,
            num_workers=2,
            multiprocessing_context="spawn",
            generator=detctx.loader_generator(),
            worker_init_fn=detctx.seed_worker,
        )
        return [list(item) for item in loader]


def run_rank(rank: int, store_file: str, out_dir: str) -> None:
    store = dist.FileStore(store_file, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        epochs = [epoch(), epoch()]
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(epochs))


def main() -> None:
    out = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as folder:
        os.environ.pop("RANK", None)
        mp.spawn(run_rank, args=(str(Path(folder, "store")), folder), nprocs=WORLD)
        result = {rank: json.loads(Path(folder, f"{rank}.json").read_text()) for rank in range(2)}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
