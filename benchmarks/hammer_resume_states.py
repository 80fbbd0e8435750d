"""Hammer ``detctx.resume`` with crafted loader states; print how each ended.

    python benchmarks/hammer_resume_states.py --mutations 2000 --worker-mutations 200 \
        --rng-flips 2000

A real state is saved after the first batch of a shuffled 12-item loader
(batches of 4, 0 or 2 workers, augmentation drawing from torch in
``__getitem__``). Each mutation takes one value of ``state["loaders"]`` and
replaces it (a small int, a bool, ``None``, a string, a short tensor, another
generator's state), deletes it, or adds a key beside it; each RNG flip turns
one bit of the main process's saved Python, NumPy or torch state (the
Mersenne Twister words and position, NumPy's key, position and Gaussian
cache, torch's bytes); then resumes a fresh loader from it. Outcomes:

- ``refused``: ``CheckpointError``, with every RNG and the loader as before;
- ``exact``: accepted, and the main process's streams and the loader give the
  straight run's draws and batches;
- ``refused_changed``, ``different``, ``other_error``: failures (each printed).

The figures are those quoted in docs/resume.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import warnings
from collections import Counter
from typing import Any

import numpy as np
import torch

import detctx
from detctx import CheckpointError


class Items(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), torch.rand(()).item()])


def build(workers: int) -> Any:
    return detctx.resumable_loader(Items(), batch_size=4, shuffle=True, num_workers=workers, seed=3)


def values(batches: Any) -> list[float]:
    return [value for batch in batches for value in batch.flatten().tolist()]


def draws() -> list[float]:
    """One draw from each of the main process's streams."""
    return [
        random.random(),
        float(np.random.random()),
        float(np.random.randn()),
        torch.rand(()).item(),
    ]


def saved(workers: int) -> tuple[dict[str, Any], list[Any]]:
    """The state, and what follows it: the streams' fingerprint, draws and batches."""
    with detctx.deterministic(seed=1):
        loader = build(workers)
        iterator = iter(loader)
        next(iterator)
        state = detctx.resume_state(loader)
        return state, [detctx.fingerprint(), *draws(), *values(iterator), *values(loader)]


def places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path in ``value``, containers included."""
    found = [path]
    if isinstance(value, dict):
        found += [p for key in value for p in places(value[key], (*path, key))]
    elif isinstance(value, list):
        found += [p for index, item in enumerate(value) for p in places(item, (*path, index))]
    return found


def replacement(rng: random.Random) -> Any:
    choice = rng.randrange(7)
    if choice == 0:
        return rng.randint(-3, 40)
    if choice == 1:
        return rng.choice([True, False])
    if choice == 2:
        return None
    if choice == 3:
        return rng.choice(["3", "", "worker_0"])
    if choice == 4:
        return torch.zeros(rng.randint(0, 8), dtype=torch.uint8)
    if choice == 5:
        return torch.Generator().manual_seed(rng.randint(0, 5)).get_state()
    return rng.choice([{}, []])


def mutate(state: dict[str, Any], rng: random.Random) -> str:
    *path, last = rng.choice(places(state["loaders"])[1:])
    parent: Any = state["loaders"]
    for key in path:
        parent = parent[key]
    kind = rng.randrange(5)
    if kind == 0 and isinstance(parent, dict):
        del parent[last]
        return f"delete {(*path, last)}"
    if kind == 1 and isinstance(parent, dict):
        parent["extra"] = 0
        return f"add 'extra' beside {(*path, last)}"
    new = replacement(rng)
    parent[last] = new
    return f"{(*path, last)} = {new if not isinstance(new, torch.Tensor) else tuple(new.shape)}"


def flip(state: dict[str, Any], rng: random.Random) -> str:
    sources = state["rng"]["sources"]
    python, numpy = sources["python"]["state"], sources["numpy"]["state"]
    name = rng.choice(["python", "numpy key", "numpy pos", "numpy has_gauss", "torch"])
    if name in ("numpy pos", "numpy has_gauss"):
        key = name.split()[1]
        numpy[key] ^= 1 << rng.randrange(1 if key == "has_gauss" else 10)
        return f"{name} = {numpy[key]}"
    words = {"python": python["internal"], "numpy key": numpy["key"]}.get(name)
    raw = (sources["torch"]["state"] if words is None else words).view(torch.uint8)
    place, bit = rng.randrange(raw.numel()), rng.randrange(8)
    raw[place] ^= 1 << bit
    return f"{name} byte {place} bit {bit}"


def trial(
    good: dict[str, Any],
    rest: list[Any],
    workers: int,
    rng: random.Random,
    edit: Any = mutate,
) -> str:
    state = copy.deepcopy(good)
    what = edit(state, rng)
    with detctx.deterministic(seed=1):
        loader = build(workers)
        before = detctx.fingerprint()
        try:
            detctx.resume(state, loader)
        except CheckpointError:
            if detctx.fingerprint() == before and loader.next_iter_state is None:
                return "refused"
            print("refused but changed:", what)
            return "refused_changed"
        except Exception as exc:  # a failure to report, whatever it is
            print("other error:", what, repr(exc)[:200])
            return "other_error"
        try:
            # The fingerprint first: a flip in a word already drawn changes no draw until
            # the next 624-word refill.
            served = [detctx.fingerprint(), *draws(), *values(loader), *values(loader)]
        except Exception as exc:
            print("accepted, then failed:", what, repr(exc)[:200])
            return "other_error"
        if served == rest:
            return "exact"
        print("accepted with other data:", what)
        return "different"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mutations", type=int, default=2000)
    parser.add_argument("--worker-mutations", type=int, default=200)
    parser.add_argument("--rng-flips", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    rng = random.Random(options.seed)
    report = {}
    for workers, count in ((0, options.mutations), (2, options.worker_mutations)):
        good, rest = saved(workers)
        report[f"{workers} workers"] = dict(
            Counter(trial(good, rest, workers, rng) for _ in range(count))
        )
    good, rest = saved(0)
    report["rng flips"] = dict(
        Counter(trial(good, rest, 0, rng, flip) for _ in range(options.rng_flips))
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
