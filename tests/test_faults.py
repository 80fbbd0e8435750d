"""Faults in the middle of seeding, forks while a block is open, and the generator stack."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from conftest import CounterSource, run_python
from helpers import DETERMINISM_ENV, draws

import detctx


class _Unseedable(CounterSource):
    """A user RNG whose seeding fails (a device that went away, say)."""

    def seed(self, seed: int) -> None:
        raise RuntimeError("cannot seed: the device went away")


def _world() -> tuple[str, bool, dict[str, str | None]]:
    env = {name: os.environ.get(name) for name in DETERMINISM_ENV}
    return detctx.fingerprint(), torch.are_deterministic_algorithms_enabled(), env


def test_seed_all_whose_registered_source_cannot_be_seeded_leaves_nothing_seeded() -> None:
    draws()
    detctx.register_source("unseedable", _Unseedable())
    try:
        before = _world()
        with pytest.raises(RuntimeError, match="went away"):
            detctx.seed_all(7)
        assert _world() == before
    finally:
        detctx.unregister_source("unseedable")


def test_a_child_forked_while_another_thread_is_inside_a_block_can_enter_blocks() -> None:
    output = run_python(
        """
        import os, threading, time, detctx
        inside, leave = threading.Event(), threading.Event()

        def hold_a_block():
            with detctx.deterministic(seed=1):
                inside.set()
                leave.wait()

        holder = threading.Thread(target=hold_a_block)
        holder.start()
        inside.wait()
        pid = os.fork()
        if pid == 0:
            with detctx.deterministic(seed=2) as seeding:
                ok = seeding.seed == 2 and len(detctx.open_blocks()) == 1
            os._exit(0 if ok and detctx.open_blocks() == () else 3)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child exit", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung")
        leave.set()
        holder.join()
        """,
        timeout=60,
    )
    assert "child exit 0" in output


def test_a_child_forked_inside_a_block_still_exits_that_block() -> None:
    output = run_python(
        """
        import os, random, detctx
        before = random.getstate()
        with detctx.deterministic(seed=2):
            pid = os.fork()
            if pid == 0:
                try:
                    with detctx.deterministic(seed=3):
                        pass
                except BaseException:
                    os._exit(4)
        if pid == 0:
            os._exit(0 if random.getstate() == before and detctx.open_blocks() == () else 5)
        print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        """,
        timeout=60,
    )
    assert "child exit 0" in output


def _seeds() -> tuple[int, ...]:
    return tuple(seeding.seed for seeding in detctx.open_blocks())


@pytest.mark.parametrize("caller_in_a_block", [False, True])
def test_a_block_closed_by_a_decorated_generator_stays_closed_on_later_steps(
    caller_in_a_block: bool,
) -> None:
    seen: list[tuple[int, ...]] = []

    @detctx.deterministic(seed=1)
    def steps() -> Iterator[int]:
        with detctx.deterministic(seed=2):
            seen.append(_seeds())
            yield 1
            seen.append(_seeds())
        yield 2
        seen.append(_seeds())
        yield 3
        seen.append(_seeds())

    outer = (9,) if caller_in_a_block else ()
    with detctx.deterministic(seed=9) if caller_in_a_block else contextlib.nullcontext():
        between = [_seeds() for _ in steps()]

    assert seen == [(*outer, 2), (*outer, 2), outer, outer]
    assert between == [outer, outer, outer]
    assert detctx.open_blocks() == ()
