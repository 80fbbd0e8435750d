"""What the tests and their child scripts share: seeding, draws and a decorated stream.

A plain module (no pytest), so that the scripts run in child processes
(``hammer_interrupts.py``, ``distributed_worker.py``) import it too: they run
from ``tests/``, and ``conftest.run_python`` puts ``tests/`` on the path.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

import detctx
from detctx._basics.seeds import SEED_ENV
from detctx._environment import env_switches, inductor

DETERMINISM_ENV = (*(switch.variable for switch in env_switches()), SEED_ENV, inductor.VARIABLE)
"""The variables a block may set, read from the switch table: each test starts with them
unset (see conftest), and the fault tests check they come back."""


def mindspeed_seed(seed: int) -> None:
    """MindSpeed-LLM's seeding order (also Lightning's seed_everything, HF's set_seed)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def draws(*generators: Any) -> tuple[float, ...]:
    """One draw from Python's, NumPy's and torch's CPU global RNGs, then one from each
    of ``generators`` (a ``torch.Generator``, a NumPy ``Generator`` or ``RandomState``,
    or anything with a ``random()`` method, such as ``random.Random``)."""
    values = [random.random(), float(np.random.rand()), float(torch.rand(1))]
    for generator in generators:
        if isinstance(generator, torch.Generator):
            values.append(float(torch.rand(1, generator=generator)))
        elif isinstance(generator, np.random.Generator):
            values.append(float(generator.random()))
        elif isinstance(generator, np.random.RandomState):
            values.append(float(generator.rand()))
        else:
            values.append(float(generator.random()))
    return tuple(values)


@detctx.deterministic(seed=3)
def augment(rounds: int | None = None) -> Iterator[float]:
    """An augmentation stream in its own seeded world, ``rounds`` rounds long (endless
    with None): each round draws NumPy inside a nested block, then Python and torch."""
    for _ in range(rounds) if rounds is not None else itertools.count():
        with detctx.deterministic(seed=4):
            yield float(np.random.rand())
        yield random.random()
        yield float(torch.rand(1))


def generator_steps(rounds: int | None = None) -> None:
    """Step a fresh :func:`augment` to its end (forever with None), then close it."""
    steps = augment(rounds)
    try:
        for _ in steps:
            pass
    finally:
        steps.close()


class NoisyPoints(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """20 points; every read adds torch, NumPy and Python noise (random augmentation)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(20, 4, generator=generator)
        self.y = torch.randn(20, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.1 * torch.randn(4) + float(np.random.normal()) * 0.01 + random.random() * 0.01
        return self.x[index] + noise, self.y[index]


class IndexedPoints(torch.utils.data.Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """:class:`NoisyPoints` with each sample's index, to check which samples a rank read."""

    def __init__(self) -> None:
        self.points = NoisyPoints()

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return (index, *self.points[index])


def fork_ranks(run_rank: Any, world: int, *args: Any) -> None:
    """Run ``run_rank(rank, *args)`` in one forked process per rank; exit with the worst code.

    What the first ``use_deterministic_algorithms()`` imports (seconds of CPU) is
    imported once here, so the forked ranks do not each pay for it on two cores.
    """
    import multiprocessing
    import sys

    import torch._inductor.config  # noqa: F401

    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=run_rank, args=(rank, *args)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    sys.exit(max(abs(process.exitcode or 0) for process in ranks))
