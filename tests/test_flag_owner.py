"""One owner per piece of process state: the algorithms flag's one stack of overrides,
shared by blocks, generator worlds and regions in any thread; ``prepare_environment``
through the transaction."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import detctx
from detctx import DeterminismWarning
from detctx._switches import ALGORITHMS
from detctx.distributed import prepare_environment

Flags = tuple[bool, bool]
START: list[Flags] = [(False, False), (True, True)]


def flags() -> Flags:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def set_flags(setting: Flags) -> None:
    torch.use_deterministic_algorithms(setting[0], warn_only=setting[1])


def test_a_block_and_a_region_overlapping_in_two_threads_leave_the_flag_as_it_was() -> None:
    # The "Layers" issue's reproducer: it printed True.
    in_block, in_region, block_done = threading.Event(), threading.Event(), threading.Event()

    def part(x: torch.Tensor) -> torch.Tensor:
        in_region.set()
        block_done.wait(10)
        return x * 2

    region = detctx.deterministic_region(part)

    def a() -> None:
        with detctx.deterministic(seed=0):
            in_block.set()
            in_region.wait(10)
        block_done.set()

    def b() -> None:
        in_block.wait(10)
        with torch.no_grad():
            region(torch.ones(2))

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert flags() == (False, False)
    assert ALGORITHMS.overrides_in_force() == 0


def test_a_region_that_outlives_a_block_keeps_the_flag_on_until_it_ends() -> None:
    in_region, block_done, region_may_end = threading.Event(), threading.Event(), threading.Event()
    seen: list[Flags] = []

    def part(x: torch.Tensor) -> torch.Tensor:
        in_region.set()
        block_done.wait(10)
        seen.append(flags())  # the block has exited: the region still holds the flag
        region_may_end.wait(10)
        return x

    region = detctx.deterministic_region(part)
    thread = threading.Thread(target=lambda: region(torch.ones(1)))
    with detctx.deterministic(seed=0, algorithms="warn"):
        thread.start()
        in_region.wait(10)
    block_done.set()
    region_may_end.set()
    thread.join(30)
    assert seen == [(True, False)]
    assert flags() == (False, False)


def test_a_generator_step_and_a_region_in_another_thread_leave_the_flag_as_it_was() -> None:
    step_started, region_started, region_ended = (
        threading.Event(),
        threading.Event(),
        threading.Event(),
    )

    @detctx.deterministic(seed=1)
    def steps() -> Iterator[int]:
        while True:
            step_started.set()
            region_started.wait(10)
            yield 1

    def part(x: torch.Tensor) -> torch.Tensor:
        region_started.set()
        return x

    def other() -> None:
        step_started.wait(10)
        detctx.deterministic_region(part)(torch.ones(1))
        region_ended.set()

    thread = threading.Thread(target=other)
    thread.start()
    gen = steps()
    next(gen)  # the region began and ended in the other thread during the step
    thread.join(30)
    assert region_ended.is_set()
    assert flags() == (False, False)
    gen.close()
    assert flags() == (False, False)
    assert ALGORITHMS.overrides_in_force() == 0


class Turns:
    """Grants turns to two threads in a drawn order, so that an interleaving replays."""

    def __init__(self, order: list[int]) -> None:
        self.order = order
        self.done: set[int] = set()
        self.cond = threading.Condition()

    def wait(self, me: int) -> None:
        with self.cond:
            while True:
                while self.order and self.order[0] in self.done:
                    self.order.pop(0)
                if not self.order or self.order[0] == me:
                    if self.order:
                        self.order.pop(0)
                    self.cond.notify_all()
                    return
                self.cond.wait(0.5)

    def finish(self, me: int) -> None:
        with self.cond:
            self.done.add(me)
            self.cond.notify_all()


BLOCK_SETTINGS: list[Any] = [True, "warn", False]
blocks_program = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.sampled_from(BLOCK_SETTINGS)),
        st.just(("close",)),
        st.tuples(st.just("region"), st.sampled_from([True, "warn"])),
    ),
    max_size=8,
)
regions_program = st.lists(
    st.tuples(st.sampled_from(["forward", "backward"]), st.sampled_from([True, "warn"])),
    max_size=4,
)


def _region_call(turns: Turns, me: int, setting: Any, *, backward: bool) -> None:
    def part(x: torch.Tensor) -> torch.Tensor:
        turns.wait(me)  # inside the region's forward
        y = x * 2
        if backward:
            y.register_hook(lambda grad: (turns.wait(me), grad)[1])  # inside its backward
        return y

    x = torch.ones(2, requires_grad=backward)
    out = detctx.deterministic_region(part, algorithms=setting)(x)
    if backward:
        out.sum().backward()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    start=st.sampled_from(START),
    blocks=blocks_program,
    regions=regions_program,
    order=st.lists(st.integers(0, 1), max_size=24),
)
def test_blocks_and_regions_interleaved_across_threads_leave_the_flag_as_it_was(
    start: Flags, blocks: list[Any], regions: list[Any], order: list[int]
) -> None:
    set_flags(start)
    turns = Turns(list(order))
    errors: list[BaseException] = []

    def with_blocks() -> None:  # thread 0: nested blocks, and regions inside and between them
        opened: list[detctx.deterministic] = []
        try:
            for step in blocks:
                turns.wait(0)
                if step[0] == "open":
                    block = detctx.deterministic(seed=len(opened), algorithms=step[1])
                    block.__enter__()
                    opened.append(block)
                elif step[0] == "close" and opened:
                    opened.pop().__exit__(None, None, None)
                elif step[0] == "region":
                    _region_call(turns, 0, step[1], backward=False)
            while opened:
                turns.wait(0)
                opened.pop().__exit__(None, None, None)
        except BaseException as exc:
            errors.append(exc)
        finally:
            turns.finish(0)

    def with_regions() -> None:  # thread 1: region forwards and backwards
        try:
            for kind, setting in regions:
                turns.wait(1)
                _region_call(turns, 1, setting, backward=kind == "backward")
        except BaseException as exc:
            errors.append(exc)
        finally:
            turns.finish(1)

    threads = [threading.Thread(target=with_blocks), threading.Thread(target=with_regions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert flags() == start
    assert ALGORITHMS.overrides_in_force() == 0


def test_seed_all_keeps_the_flag_on_and_leaves_no_override_behind() -> None:
    for _ in range(3):
        detctx.seed_all(0)
    assert flags() == (True, False)
    assert ALGORITHMS.overrides_in_force() == 0


def test_a_generator_parked_with_an_open_block_gives_the_caller_its_flag_between_steps() -> None:
    @detctx.deterministic(seed=2, algorithms=False)
    def steps() -> Iterator[Flags]:
        with detctx.deterministic(seed=3, algorithms="warn"):
            while True:
                yield flags()

    gen = steps()
    assert next(gen) == (True, True)
    assert flags() == (False, False)
    assert next(gen) == (True, True)
    gen.close()
    assert flags() == (False, False)
    assert ALGORITHMS.overrides_in_force() == 0


# --- prepare_environment ------------------------------------------------------------------


def test_prepare_environment_that_fails_half_way_leaves_no_variable_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CUDA already initialised and the too-late warning an error: it raised, and before,
    # PYTHONHASHSEED (set before CUBLAS_WORKSPACE_CONFIG) stayed set.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    before = dict(os.environ)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeterminismWarning)
        with pytest.raises(DeterminismWarning, match="CUBLAS_WORKSPACE_CONFIG"):
            prepare_environment(seed=7)
    assert dict(os.environ) == before


def test_prepare_environment_interrupted_half_way_leaves_no_variable_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupted() -> str | None:
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", interrupted)
    before = dict(os.environ)
    with pytest.raises(KeyboardInterrupt):
        prepare_environment(seed=7)
    assert dict(os.environ) == before
