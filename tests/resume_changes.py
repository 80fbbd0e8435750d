"""A loader state saved with one configuration, resumed into loaders built differently.

``python [-O] tests/resume_changes.py`` prints, as JSON, each case's outcome:
the ``CheckpointError`` message of a refusal (after checking that the RNGs
and the loader were left as they were), or ``"exact"`` for a resume that
served the straight run's batches. ``test_resume_changes.py`` runs it in
the test process and under ``python -O`` (where torchdata's own ``assert``
checks are gone).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import detctx
from detctx import CheckpointError

SAVED = {"num_workers": 2, "batch_size": 8, "shuffle": True}


class Items(torch.utils.data.Dataset[torch.Tensor]):
    """``size`` items, each its index and a torch draw (in the worker that reads it)."""

    def __init__(self, size: int = 12) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), torch.rand(()).item()])


@contextmanager
def placed(rank: int, world: int) -> Iterator[None]:
    """``$RANK`` and ``$WORLD_SIZE`` as torchrun sets them, while a loader is built."""
    before = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def loader(size: int = 12, rank: int = 0, world: int = 1, **changes: Any) -> Any:
    with placed(rank, world):
        return detctx.resumable_loader(Items(size), seed=4, **{**SAVED, **changes})


def flat(batches: Any) -> list[float]:
    return [value for batch in batches for value in batch.flatten().tolist()]


def own_generator() -> torch.Generator:
    return torch.Generator().manual_seed(5)


CASES: dict[str, Callable[[], Any]] = {
    "unchanged": lambda: loader(),
    "num_workers 2 -> 0": lambda: loader(num_workers=0),
    "num_workers 2 -> 1": lambda: loader(num_workers=1),
    "num_workers 2 -> 3": lambda: loader(num_workers=3),
    "batch_size 8 -> 4": lambda: loader(batch_size=4),
    "drop_last False -> True": lambda: loader(drop_last=True),
    "dataset length 12 -> 4": lambda: loader(size=4),
    "dataset length 12 -> 8": lambda: loader(size=8),
    "dataset length 12 -> 20": lambda: loader(size=20),
    "shuffle -> a RandomSampler": lambda: loader(
        shuffle=False, sampler=torch.utils.data.RandomSampler(Items(), generator=own_generator())
    ),
    "shuffle -> in order": lambda: loader(shuffle=False),
    "rank 0 -> rank 1": lambda: loader(rank=1, world=2),
    "world size 1 -> 2": lambda: loader(rank=0, world=2),
}


def outcomes() -> dict[str, str]:
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    with placed(0, 1), detctx.deterministic(seed=1):
        saving = loader()
        iterator = iter(saving)
        next(iterator)
        state = detctx.resume_state(saving)
        rest = flat(iterator) + flat(saving)
    results = {}
    for name, build in CASES.items():
        with detctx.deterministic(seed=2):
            resumed = build()
            before = detctx.fingerprint()
            try:
                detctx.resume(state, resumed)
            except CheckpointError as exc:
                unchanged = detctx.fingerprint() == before and resumed.next_iter_state is None
                results[name] = str(exc) if unchanged else f"CHANGED: {exc}"
                continue
            results[name] = "exact" if flat(resumed) + flat(resumed) == rest else "DIFFERENT"
    return results


if __name__ == "__main__":
    print(json.dumps(outcomes()))
