"""@deterministic on functions, generators, coroutines, async generators and test classes."""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import threading
import unittest
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from helpers import draws, mindspeed_seed
from hypothesis import given, settings
from hypothesis import strategies as st

import detctx


def seeded_draws(seed: int, count: int) -> list[tuple[object, ...]]:
    """What ``count`` calls of ``draws()`` give right after seeding everything with ``seed``."""
    mindspeed_seed(seed)
    return [draws() for _ in range(count)]


@detctx.deterministic(seed=7)
def stream() -> Iterator[tuple[object, ...]]:
    """An endless augmentation-like stream: one draw from every RNG per item."""
    while True:
        yield draws()


# --- plain functions ----------------------------------------------------------------------------


def test_each_call_of_a_decorated_function_is_its_own_block() -> None:
    @detctx.deterministic(seed=3)
    def evaluate() -> tuple[object, ...]:
        assert torch.are_deterministic_algorithms_enabled()
        return draws()

    mindspeed_seed(100)
    first, second = evaluate(), evaluate()
    after = draws()
    assert first == second == seeded_draws(3, 1)[0]
    assert after == seeded_draws(100, 1)[0]
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_decorated_function_restores_when_it_raises() -> None:
    @detctx.deterministic(seed=3)
    def broken() -> None:
        draws()
        raise KeyError("boom")

    mindspeed_seed(100)
    with pytest.raises(KeyError):
        broken()
    assert draws() == seeded_draws(100, 1)[0]


def test_recursion_gives_every_level_its_own_block() -> None:
    @detctx.deterministic(seed=5)
    def depth_draws(level: int) -> list[tuple[object, ...]]:
        here = draws()
        return [here, *depth_draws(level - 1)] if level else [here]

    assert depth_draws(3) == seeded_draws(5, 1) * 4


def test_wraps_keeps_name_doc_and_signature() -> None:
    def evaluate(model: str, *, batches: int = 2) -> str:
        """Evaluate the model."""
        return model * batches

    async def sample(prompt: str) -> str:
        """Sample a completion."""
        return prompt

    def augment(items: list[int]) -> Iterator[int]:
        """Jitter each item."""
        yield from items

    async def stream_tokens(n: int) -> AsyncIterator[int]:
        """Stream tokens."""
        for i in range(n):
            yield i

    for func in (evaluate, sample, augment, stream_tokens):
        wrapped = detctx.deterministic(seed=0)(func)
        assert wrapped.__name__ == func.__name__
        assert wrapped.__doc__ == func.__doc__
        assert inspect.signature(wrapped) == inspect.signature(func)
    # Frameworks (pytest fixtures, asyncio) tell the kinds apart; the wrappers keep the kind.
    assert inspect.iscoroutinefunction(detctx.deterministic()(sample))
    assert inspect.isgeneratorfunction(detctx.deterministic()(augment))
    assert inspect.isasyncgenfunction(detctx.deterministic()(stream_tokens))


@detctx.deterministic(seed=11)
def test_pytest_fixtures_resolve_through_the_decorator(tmp_path: Path) -> None:
    first = draws()
    assert tmp_path.is_dir()
    assert first == seeded_draws(11, 1)[0]


@pytest.fixture
@detctx.deterministic(seed=13)
def seeded_weights() -> Iterator[torch.Tensor]:
    yield torch.randn(3)


def test_a_decorated_generator_fixture_yields_seeded_values(seeded_weights: torch.Tensor) -> None:
    torch.manual_seed(13)
    assert torch.equal(seeded_weights, torch.randn(3))


# --- generators ---------------------------------------------------------------------------------


def test_a_generator_draws_as_if_seeded_at_its_first_step() -> None:
    assert list(itertools.islice(stream(), 4)) == seeded_draws(7, 4)


def test_the_callers_streams_between_steps_are_as_if_the_generator_did_not_exist() -> None:
    reference = seeded_draws(100, 4)
    mindspeed_seed(100)
    items = stream()
    seen = []
    for _ in range(4):
        seen.append(draws())
        next(items)
        assert not torch.are_deterministic_algorithms_enabled()
    assert seen == reference


def test_a_generators_draws_do_not_depend_on_what_the_caller_draws() -> None:
    items = stream()
    got = []
    for step in range(4):
        for _ in range(step):
            draws()
        got.append(next(items))
    assert got == seeded_draws(7, 4)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["first", "second", "caller"]), max_size=24))
def test_interleaved_generators_each_produce_what_they_produce_alone(schedule: list[str]) -> None:
    mindspeed_seed(100)
    generators = {"first": stream(), "second": stream()}
    produced: dict[str, list[tuple[object, ...]]] = {"first": [], "second": [], "caller": []}
    for who in schedule:
        if who == "caller":
            produced[who].append(draws())
        else:
            produced[who].append(next(generators[who]))
    assert produced["first"] == seeded_draws(7, len(produced["first"]))
    assert produced["second"] == seeded_draws(7, len(produced["second"]))
    assert produced["caller"] == seeded_draws(100, len(produced["caller"]))


def test_return_value_and_return_inside_with() -> None:
    depth = len(detctx.open_blocks())  # blocks open around the test (pytest --detctx-seed)

    @detctx.deterministic(seed=2)
    def head(n: int) -> Iterator[tuple[object, ...]]:
        with detctx.deterministic(seed=9):
            yield draws()
            return n * 10

    mindspeed_seed(100)
    items = head(4)
    assert next(items) == seeded_draws(9, 1)[0]
    mindspeed_seed(100)
    with pytest.raises(StopIteration) as stop:
        next(items)
    assert stop.value.value == 40
    assert draws() == seeded_draws(100, 1)[0]
    assert len(detctx.open_blocks()) == depth


def test_close_runs_the_body_cleanup_in_its_own_world() -> None:
    cleanup: list[tuple[object, ...]] = []

    @detctx.deterministic(seed=4)
    def with_cleanup() -> Iterator[tuple[object, ...]]:
        try:
            while True:
                yield draws()
        finally:
            cleanup.append(draws())

    items = with_cleanup()
    next(items)
    mindspeed_seed(100)
    items.close()
    assert cleanup == seeded_draws(4, 2)[1:]
    mindspeed_seed(100)
    assert draws() == seeded_draws(100, 1)[0]


def test_throw_is_handled_in_the_generators_world() -> None:
    @detctx.deterministic(seed=4)
    def resilient() -> Iterator[tuple[object, ...]]:
        while True:
            try:
                yield draws()
            except ValueError:
                draws()

    items = resilient()
    next(items)
    mindspeed_seed(100)
    after_throw = items.throw(ValueError("skip"))
    caller = draws()
    assert after_throw == seeded_draws(4, 3)[2]
    assert caller == seeded_draws(100, 1)[0]


def test_an_uncaught_throw_or_exception_restores_the_caller() -> None:
    @detctx.deterministic(seed=4)
    def fragile() -> Iterator[int]:
        draws()
        yield 1
        draws()
        raise RuntimeError("bad batch")

    items = fragile()
    next(items)
    mindspeed_seed(100)
    with pytest.raises(RuntimeError, match="bad batch"):
        next(items)
    assert draws() == seeded_draws(100, 1)[0]
    assert not torch.are_deterministic_algorithms_enabled()

    items = fragile()
    next(items)
    mindspeed_seed(100)
    with pytest.raises(KeyError):
        items.throw(KeyError("stop"))
    assert draws() == seeded_draws(100, 1)[0]


def test_blocks_inside_a_generator_nest_independently_of_the_callers_blocks() -> None:
    depth = len(detctx.open_blocks())  # blocks open around the test (pytest --detctx-seed)

    @detctx.deterministic(seed=2)
    def two_phases() -> Iterator[tuple[object, ...]]:
        with detctx.deterministic(seed=9):
            yield draws()
            yield draws()
        yield draws()

    items = two_phases()
    with detctx.deterministic(seed=1):
        first = next(items)
    # The caller's block is gone while the generator's is still open: no out-of-order exit.
    with detctx.deterministic(seed=1):
        second = next(items)
        caller = draws()
    third = next(items)
    assert [first, second] == seeded_draws(9, 2)
    assert third == seeded_draws(2, 1)[0]
    assert caller == seeded_draws(1, 1)[0]
    assert len(detctx.open_blocks()) == depth


def test_a_suspended_generator_holding_a_block_does_not_block_other_threads() -> None:
    if detctx.open_blocks():
        pytest.skip("an enclosing block (pytest --detctx-seed) holds the lock for the whole test")

    @detctx.deterministic(seed=2)
    def holding() -> Iterator[int]:
        with detctx.deterministic(seed=9):
            yield 1
            yield 2

    items = holding()
    next(items)
    done = threading.Event()

    def other() -> None:
        with detctx.deterministic(seed=1):
            done.set()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(10)
    assert done.is_set()
    assert list(items) == [2]


def test_recursive_generators_each_get_their_own_world() -> None:
    @detctx.deterministic(seed=6)
    def walk(depth: int) -> Iterator[tuple[object, ...]]:
        yield draws()
        if depth:
            yield from walk(depth - 1)
        yield draws()

    expected_first, expected_second = seeded_draws(6, 2)
    assert list(walk(2)) == [expected_first] * 3 + [expected_second] * 3


def test_seed_none_reads_detctx_seed_on_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    @detctx.deterministic(seed=None)
    def from_env() -> Iterator[tuple[object, ...]]:
        yield draws()

    items = from_env()
    monkeypatch.setenv("DETCTX_SEED", "21")
    assert next(items) == seeded_draws(21, 1)[0]


# --- coroutines ---------------------------------------------------------------------------------


@detctx.deterministic(seed=3)
async def sample(steps: int) -> list[tuple[object, ...]]:
    out = []
    for _ in range(steps):
        out.append(draws())
        await asyncio.sleep(0)
    return out


def test_concurrent_coroutines_each_produce_what_they_produce_alone() -> None:
    async def bystander(steps: int) -> list[tuple[object, ...]]:
        out = []
        for _ in range(steps):
            out.append(draws())
            await asyncio.sleep(0)
        return out

    async def main() -> tuple[list[tuple[object, ...]], ...]:
        mindspeed_seed(100)
        return tuple(await asyncio.gather(sample(5), bystander(5), sample(3)))

    first, other, second = asyncio.run(main())
    assert first == seeded_draws(3, 5)
    assert second == seeded_draws(3, 3)
    assert other == seeded_draws(100, 5)
    assert not torch.are_deterministic_algorithms_enabled()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=4))
def test_coroutines_with_arbitrary_interleaving(delays: list[int]) -> None:
    @detctx.deterministic(seed=3)
    async def staggered(delay: int) -> list[tuple[object, ...]]:
        out = []
        for _ in range(3):
            for _ in range(delay):
                await asyncio.sleep(0)
            out.append(draws())
        return out

    async def main() -> list[list[tuple[object, ...]]]:
        return list(await asyncio.gather(*(staggered(d) for d in delays)))

    assert asyncio.run(main()) == [seeded_draws(3, 3)] * len(delays)


def test_cancellation_restores_the_tasks_own_world() -> None:
    started = []

    @detctx.deterministic(seed=3)
    async def endless() -> None:
        while True:
            started.append(draws())
            await asyncio.sleep(0)

    async def main() -> tuple[object, ...]:
        mindspeed_seed(100)
        task = asyncio.create_task(endless())
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return draws()

    assert asyncio.run(main()) == seeded_draws(100, 1)[0]
    assert started == seeded_draws(3, len(started))
    assert not torch.are_deterministic_algorithms_enabled()


def test_coroutine_results_exceptions_and_nesting() -> None:
    @detctx.deterministic(seed=8)
    async def outer() -> tuple[object, ...]:
        first = draws()
        inner = await sample(1)
        await asyncio.sleep(0)
        return first, inner[0], draws()

    @detctx.deterministic(seed=8)
    async def failing() -> None:
        draws()
        await asyncio.sleep(0)
        raise ValueError("bad prompt")

    mindspeed_seed(100)
    first, inner, second = asyncio.run(outer())
    assert [first, second] == seeded_draws(8, 2)
    assert inner == seeded_draws(3, 1)[0]
    mindspeed_seed(100)
    with pytest.raises(ValueError, match="bad prompt"):
        asyncio.run(failing())
    assert draws() == seeded_draws(100, 1)[0]


def test_blocks_held_across_awaits_in_two_decorated_tasks_do_not_clash() -> None:
    depth = len(detctx.open_blocks())  # blocks open around the test (pytest --detctx-seed)

    @detctx.deterministic(seed=2)
    async def task(seed: int, hold: float) -> tuple[object, ...]:
        with detctx.deterministic(seed=seed):
            await asyncio.sleep(hold)
            return draws()

    async def main() -> list[tuple[object, ...]]:
        return list(await asyncio.gather(task(1, 0.01), task(5, 0.0)))

    assert asyncio.run(main()) == [seeded_draws(1, 1)[0], seeded_draws(5, 1)[0]]
    assert len(detctx.open_blocks()) == depth


# --- async generators ---------------------------------------------------------------------------


@detctx.deterministic(seed=5)
async def token_stream(n: int) -> AsyncIterator[tuple[object, ...]]:
    for _ in range(n):
        await asyncio.sleep(0)
        yield draws()
        await asyncio.sleep(0)


def test_async_generators_consumed_concurrently_produce_what_they_produce_alone() -> None:
    async def consume(n: int) -> list[tuple[object, ...]]:
        return [item async for item in token_stream(n)]

    async def main() -> list[list[tuple[object, ...]]]:
        mindspeed_seed(100)
        results = list(await asyncio.gather(consume(4), consume(2)))
        results.append([draws()])
        return results

    first, second, caller = asyncio.run(main())
    assert first == seeded_draws(5, 4)
    assert second == seeded_draws(5, 2)
    assert caller == seeded_draws(100, 1)


def test_async_generator_aclose_and_athrow_run_in_its_world() -> None:
    cleanup: list[tuple[object, ...]] = []

    @detctx.deterministic(seed=5)
    async def guarded() -> AsyncIterator[tuple[object, ...]]:
        try:
            while True:
                try:
                    yield draws()
                except ValueError:
                    await asyncio.sleep(0)
        finally:
            cleanup.append(draws())

    async def main() -> tuple[object, ...]:
        items = guarded()
        first = await items.__anext__()
        mindspeed_seed(100)
        after_throw = await items.athrow(ValueError("skip"))
        await items.aclose()
        return first, after_throw, draws()

    first, after_throw, caller = asyncio.run(main())
    assert [first, after_throw, *cleanup] == seeded_draws(5, 3)
    assert caller == seeded_draws(100, 1)[0]


# --- classes ------------------------------------------------------------------------------------


@detctx.deterministic(seed=5)
class TestDecoratedCase(unittest.TestCase):
    """pytest collects this case; each method must start from seed 5's state."""

    def setUp(self) -> None:
        mindspeed_seed(100)

    def test_first(self) -> None:
        first = draws()
        self.assertEqual(first, seeded_draws(5, 1)[0])

    def test_second(self) -> None:
        draws()
        self.assertTrue(torch.are_deterministic_algorithms_enabled())


def test_every_test_method_of_a_test_case_starts_from_the_seeded_state() -> None:
    firsts: list[tuple[object, ...]] = []

    class Base(unittest.TestCase):
        def test_inherited(self) -> None:
            firsts.append(draws())

    @detctx.deterministic(seed=5)
    class Case(Base):
        helper_value = 3

        def test_a(self) -> None:
            firsts.append(draws())
            draws()

        def test_b(self) -> None:
            firsts.append(draws())

        @staticmethod
        def test_static() -> None:
            firsts.append(draws())

        def not_a_test(self) -> tuple[object, ...]:
            return draws()

    @detctx.deterministic(seed=5)
    class AsyncCase(unittest.IsolatedAsyncioTestCase):
        async def test_async(self) -> None:
            await asyncio.sleep(0)
            firsts.append(draws())

    mindspeed_seed(100)
    result = unittest.TestResult()
    loader = unittest.defaultTestLoader
    suite = unittest.TestSuite(
        [loader.loadTestsFromTestCase(Case), loader.loadTestsFromTestCase(AsyncCase)]
    )
    suite.run(result)
    assert result.wasSuccessful(), result.errors + result.failures
    assert firsts == seeded_draws(5, 1) * 5
    assert Base.test_inherited is not Case.test_inherited
    assert Case.helper_value == 3


def test_other_classes_and_non_callables_are_rejected_at_decoration() -> None:
    before = detctx.fingerprint()

    class Model:
        pass

    with pytest.raises(TypeError, match=r"unittest\.TestCase subclass.*Model"):
        detctx.deterministic(seed=0)(Model)
    with pytest.raises(TypeError, match="not int objects"):
        detctx.deterministic(seed=0)(42)
    assert detctx.fingerprint() == before


def test_partials_and_methods_are_decorated_like_functions() -> None:
    class Evaluator:
        @detctx.deterministic(seed=3)
        def run(self) -> tuple[object, ...]:
            return draws()

        @detctx.deterministic(seed=3)
        def batches(self, n: int) -> Iterator[tuple[object, ...]]:
            for _ in range(n):
                yield draws()

    evaluator = Evaluator()
    assert evaluator.run() == seeded_draws(3, 1)[0]
    assert list(evaluator.batches(2)) == seeded_draws(3, 2)
    seeded_partial = detctx.deterministic(seed=3)(functools.partial(draws))
    assert seeded_partial() == seeded_draws(3, 1)[0]
