"""Property: a KeyboardInterrupt from any call into an RNG source, at any point of entry,
exit, a world swap, ``seed_all`` or a restore, leaves every other RNG, flag and variable
exactly as the program's structure says, and no block open."""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import numpy as np
import torch
from helpers import DETERMINISM_ENV, draws, generator_steps
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx


class Tripwire:
    """A user RNG whose ``trip_at``-th call (capture, restore or seed) raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.calls = 0
        self.trip_at = 0
        self.value = 0

    def _tick(self) -> None:
        self.calls += 1
        if self.calls == self.trip_at:
            raise KeyboardInterrupt

    def capture(self) -> int:
        self._tick()
        return self.value

    def restore(self, state: int) -> None:
        self._tick()
        self.value = state

    def seed(self, seed: int) -> None:
        self._tick()
        self.value = seed


def nested_blocks() -> None:
    with detctx.deterministic(seed=1):
        np.random.rand()
        with detctx.deterministic(seed=2, algorithms=False):
            random.random(), torch.rand(1)


PROGRAMS: dict[str, Callable[[], None]] = {
    "nested blocks": nested_blocks,
    "generator steps": lambda: generator_steps(rounds=1),
    "seed_all": lambda: detctx.seed_all(9) and None,
    "restore a checkpoint": lambda: detctx.restore(detctx.capture().state_dict()),
}


def world() -> tuple[object, ...]:
    prints = detctx.capture().source_fingerprints()
    del prints["tripwire"]
    env = tuple(os.environ.get(name) for name in DETERMINISM_ENV)
    return tuple(sorted(prints.items())), torch.are_deterministic_algorithms_enabled(), env


@settings(max_examples=120, deadline=None)
@given(program=st.sampled_from(sorted(PROGRAMS)), trip_at=st.integers(1, 30))
def test_an_interrupt_from_any_source_call_leaves_the_rest_whole(
    program: str, trip_at: int
) -> None:
    tripwire = Tripwire()
    detctx.register_source("tripwire", tripwire)
    detctx.register_source("sampler", random.Random(5))  # restored after the tripwire
    try:
        draws()
        before = world()
        tripwire.trip_at = trip_at
        try:
            PROGRAMS[program]()
        except KeyboardInterrupt:
            interrupted = True
        else:
            interrupted = False
        tripwire.trip_at = 0
        assert detctx.open_blocks() == ()
        if interrupted or program in ("nested blocks", "generator steps"):
            assert world() == before
    finally:
        detctx.unregister_source("tripwire")
        detctx.unregister_source("sampler")
