"""``@deterministic(...)`` on functions, generators, coroutines and test classes.

A plain function call is one block. A generator, async generator or coroutine
call gets its own RNG *world* instead: a private :class:`~detctx._state.snapshot.Snapshot`
(every RNG state and every switch) that is swapped in each time its body is
resumed and swapped out again, with the caller's world put back, each time it
stops (yield, ``await`` suspension, ``close``, ``throw``, return, exception).
So its draws depend only on the seed and its own work, and the caller's
streams between steps are exactly what they would be without it.
"""

from __future__ import annotations

import functools
import inspect
import sys
import unittest
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator
from types import TracebackType
from typing import Any, Protocol

import detctx._blocks.stack as blocks
from detctx._blocks.settings import Entry, Seeding, Settings
from detctx._state import Snapshot, interrupts, transaction

__all__ = ["Block", "decorate", "is_hypothesis_test"]


class Block(Protocol):
    """What the decorator forms need of a block: its settings, and ``with`` for functions."""

    @property
    def settings(self) -> Settings: ...

    def __enter__(self) -> Seeding: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


def decorate(block: Block, target: Any) -> Any:
    """Wrap ``target`` so that it runs under ``block``; see :meth:`deterministic.__call__`."""
    if inspect.isclass(target):
        if issubclass(target, unittest.TestCase):
            return _decorate_test_case(block, target)
        raise TypeError(
            f"{block!r} can decorate a class only if it is a unittest.TestCase subclass "
            f"(each test method then runs in its own block); decorate the methods of "
            f"{target.__qualname__} instead"
        )
    if not callable(target):
        raise TypeError(
            f"{block!r} decorates functions, generator functions, coroutine functions and "
            f"unittest.TestCase classes, not {type(target).__name__} objects; "
            f"use 'with {block!r}:' around a block of code"
        )
    if is_hypothesis_test(target):
        return _decorate_hypothesis_test(block, target)
    if inspect.isasyncgenfunction(target):
        return _wrap_async_generator(block, target)
    if inspect.iscoroutinefunction(target):
        return _wrap_coroutine(block, target)
    if inspect.isgeneratorfunction(target):
        return _wrap_generator(block, target)
    return _wrap_function(block, target)


def _wrap_function(block: Block, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with block:
            return func(*args, **kwargs)

    return wrapper


def _wrap_generator(block: Block, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        return (yield from _drive(_World(block), func(*args, **kwargs), returns_at_end=True))

    return wrapper


def _wrap_coroutine(block: Block, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        return await _Steps(_World(block), func(*args, **kwargs), returns_at_end=True)

    return wrapper


def _wrap_async_generator(block: Block, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        inner = func(*args, **kwargs)
        world = _World(block)
        # Each asend/athrow/aclose awaitable is driven step by step, so the
        # world is swapped around every await inside the body too.
        step: Coroutine[Any, Any, Any] = inner.asend(None)
        while True:
            try:
                item = await _Steps(world, step, returns_at_end=False)
            except StopAsyncIteration:
                return
            try:
                sent = yield item
            except GeneratorExit:
                await _Steps(world, inner.aclose(), returns_at_end=True)
                raise
            except BaseException as exc:
                step = inner.athrow(exc)
            else:
                step = inner.asend(sent)

    return wrapper


def _decorate_test_case(block: Block, cls: type[unittest.TestCase]) -> type[Any]:
    """Wrap every test method (inherited ones too), as ``unittest.mock.patch`` does."""
    prefix = unittest.TestLoader.testMethodPrefix
    for name in dir(cls):
        if not name.startswith(prefix):
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, (staticmethod, classmethod)):
            setattr(cls, name, type(attr)(decorate(block, attr.__func__)))
        elif inspect.isfunction(attr):
            setattr(cls, name, decorate(block, attr))
    return cls


def is_hypothesis_test(target: Any) -> bool:
    """Whether ``target`` is a ``@given`` test (hypothesis puts a handle with
    ``inner_test`` on it; hypothesis need not be imported to tell)."""
    return callable(getattr(getattr(target, "hypothesis", None), "inner_test", None))


def _decorate_hypothesis_test(block: Block, test: Any) -> Any:
    """Run a ``@given`` test in ``block``, and each of its examples in its own entry of it.

    hypothesis reseeds ``random`` and NumPy (not torch) around each example by
    calling ``test.hypothesis.inner_test``, its documented point for wrapping the
    example body; one block around the whole test would leave torch's stream
    running on from example to example. The outer entry also takes the first
    entry's one-off costs (``use_deterministic_algorithms`` imports
    ``torch._inductor``, about 1 s) out of the first example, which hypothesis
    would otherwise fail for exceeding its deadline.
    """
    handle = test.hypothesis
    handle.inner_test = decorate(block, handle.inner_test)
    return _wrap_function(block, test)


class _World:
    """The private RNG world of one generator, async generator or coroutine call.

    Between steps it holds the body's snapshot and the ``with deterministic``
    blocks the body has open; during a step it holds the caller's snapshot.
    Swapping in is a transaction that lasts until the swap out
    (:mod:`detctx._state.transaction`), so a step and another thread's block never
    overlap; the body's own open blocks keep their lock holds only while the
    body runs, so a suspended generator blocks no other thread.
    """

    __slots__ = ("_caller", "_parked", "_position", "_saved", "_settings", "seeding")

    def __init__(self, block: Block) -> None:
        self._settings = block.settings
        self._saved: Snapshot | None = None
        self._caller: Snapshot | None = None
        self._parked: blocks.Parked | None = None
        self._position: blocks.Position | None = None
        self.seeding: Seeding | None = None

    @interrupts.edge
    def resume(self) -> None:
        """Save the caller's world and put the body's in (seeding it on the first step)."""
        saved = self._saved
        # Decided before the transaction: it may communicate (distributed), and changes nothing.
        entry = self._settings.begin() if saved is None else None
        # The sources are looked up on every step: a source registered between steps
        # is the caller's and must be saved and put back for it.
        transaction.change(
            lambda caller: self._swap_in(caller, entry),
            Snapshot.capture_everything,
            lasts=transaction.Lasts.UNTIL_END,
            undo=lambda _: self.suspend(finished=False),
        )

    def _swap_in(self, caller: Snapshot, entry: Entry | None) -> None:
        if entry is not None:
            self.seeding = self._settings.apply(entry, caller)
        elif self._saved is not None:
            self._saved.restore_each(unchanged=caller, layered=True)
        self._caller = caller
        self._position = blocks.position()
        if self._parked is not None:
            blocks.unpark(self._parked)

    @interrupts.edge
    def suspend(self, *, finished: bool) -> None:
        """Save the body's world (unless ``finished``) and put the caller's back.

        Does nothing if the world is not swapped in (a resume that was interrupted).
        """
        caller, since = self._caller, self._position
        if caller is None or since is None:
            return
        self._caller = self._position = None

        def swap_out() -> None:
            self._parked = blocks.park(since)
            saved = None
            try:
                if not finished:
                    saved = self._saved = Snapshot.capture(caller.sources, switches=True)
            finally:
                caller.restore_each(unchanged=saved)

        transaction.end(swap_out)


def _drive(world: _World, steps: Any, *, returns_at_end: bool) -> Generator[Any, Any, Any]:
    """Run ``steps`` (a generator, coroutine, or asend/athrow/aclose awaitable) in ``world``.

    Every ``send``/``throw``/``close`` of ``steps`` runs with the world swapped
    in. ``returns_at_end``: whether ``StopIteration`` ends the body (it does for
    generators and coroutines; for an async generator's ``asend`` it is a yield).
    """
    send = steps.send
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            world.resume()
        except BaseException:  # a KeyboardInterrupt held off during the swap
            world.suspend(finished=True)
            if _suspended(steps):
                _close_in(world, steps)
            raise
        try:
            if error is None:
                item = send(value)
            else:
                item = steps.throw(error)
                error = None
        except StopIteration as stop:
            world.suspend(finished=returns_at_end)
            return stop.value
        except BaseException:
            world.suspend(finished=True)
            if _suspended(steps):  # interrupted just after the step, not raised by the body
                _close_in(world, steps)
            raise
        try:
            world.suspend(finished=False)
        except BaseException:  # a KeyboardInterrupt held off during the swap
            _close_in(world, steps)
            raise
        try:
            value = yield item
        except GeneratorExit:
            if sys.is_finalizing():
                # Closed by garbage collection at interpreter exit: there is no
                # caller left to protect, and torch may already be torn down. The
                # body's own blocks are parked, so their exits have nothing to restore.
                with blocks.discarding():
                    steps.close()
                raise
            if transaction.collecting() or transaction.held_elsewhere():
                # A finalizer run by a GC pass (where setting the ContextVar of the
                # open blocks can crash CPython), or in a thread that would wait for
                # a lock whose owner may be waiting for this thread: the body is
                # closed, in its own world, by the next change that can take the lock.
                transaction.defer(lambda: _close_in(world, steps))
                raise
            _close_in(world, steps)
            raise
        except BaseException as exc:
            error = exc


def _suspended(steps: Any) -> bool:
    """Whether a generator or coroutine body is suspended at a yield or an await."""
    if inspect.isgenerator(steps):
        return inspect.getgeneratorstate(steps) == inspect.GEN_SUSPENDED
    if inspect.iscoroutine(steps):
        return inspect.getcoroutinestate(steps) == inspect.CORO_SUSPENDED
    return False


@interrupts.edge
def _close_in(world: _World, steps: Any) -> None:
    """Close the body in its own world, so that its ``finally`` and ``with`` exits run there."""
    world.resume()
    try:
        steps.close()
    finally:
        world.suspend(finished=True)


class _Steps:
    """Awaitable that drives one coroutine or async-generator step in a world."""

    __slots__ = ("_end", "_steps", "_world")

    def __init__(self, world: _World, steps: Any, *, returns_at_end: bool) -> None:
        self._world = world
        self._steps = steps
        self._end = returns_at_end

    def __await__(self) -> Generator[Any, Any, Any]:
        return _drive(self._world, self._steps, returns_at_end=self._end)
