"""Faults in the middle of seeding, forks while a block is open, and the generator stack."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

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


class _RefusesOldStates(CounterSource):
    """A user RNG that cannot go back to a state below its current one."""

    def restore(self, state: int) -> None:
        if state < self.value:
            raise RuntimeError(f"cannot rewind from {self.value} to {state}")
        self.value = state


@pytest.mark.parametrize("restore", ["Snapshot.restore", "detctx.restore"])
def test_a_restore_with_one_source_that_fails_changes_nothing(restore: str) -> None:
    counter = _RefusesOldStates()
    detctx.register_source("one-way", counter)
    try:
        saved = detctx.Snapshot.capture()
        draws()
        counter.value = 5
        before = _world()
        with pytest.raises(RuntimeError, match="cannot rewind"):
            if restore == "Snapshot.restore":
                saved.restore()
            else:
                detctx.restore(saved.state_dict())
        assert _world() == before
        assert counter.value == 5
    finally:
        detctx.unregister_source("one-way")


@pytest.mark.slow
@pytest.mark.parametrize(
    "holding", ["a block", "a keyed world", "the lock, not yet named its owner"]
)
def test_a_child_forked_while_another_thread_holds_the_lock_can_enter_blocks(
    holding: str,
) -> None:
    # A keyed world: before, a child forked while another thread was inside an elastic
    # loader's or a keyed collator's world, before any block had been entered, kept that
    # thread's lock and its first block waited for ever (the reset lived with the blocks,
    # not imported yet). So did a child forked while a thread had taken the lock and not
    # yet named itself its owner (simulated here after a first use of the lock).
    output = run_python(
        f"""
        import os, threading, time, detctx
        from detctx._data.keyed_collate import keyed_streams
        from detctx._sources import registered_sources
        from detctx._state import transaction

        taken, leave = threading.Event(), threading.Event()

        def hold():
            if {holding!r} == "a block":
                with detctx.deterministic(seed=1):
                    taken.set()
                    leave.wait()
            elif {holding!r} == "a keyed world":
                with keyed_streams(list(registered_sources())) as reseed:
                    reseed(5)
                    taken.set()
                    leave.wait()
            else:
                transaction._mutex.acquire()
                taken.set()
                leave.wait()
                transaction._mutex.release()

        if {holding!r} == "the lock, not yet named its owner":
            with keyed_streams(list(registered_sources())):
                pass
        holder = threading.Thread(target=hold)
        holder.start()
        taken.wait()
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
        with detctx.deterministic(seed=3):
            pass
        print("parent free")
        """,
        timeout=90,
    )
    assert "child exit 0" in output
    assert "parent free" in output


@pytest.mark.slow
@pytest.mark.parametrize("holder", ["nested blocks", "a generator step"])
def test_a_child_forked_while_another_thread_is_inside_a_block_gets_the_state_from_before_it(
    holder: str,
) -> None:
    output = run_python(
        f"""
        import os, random, threading, time
        import numpy as np, torch, detctx

        def world():
            # Python's `random` is left out: a child gets a fresh one (see below).
            sources = detctx.capture().source_fingerprints()
            return (sorted((k, v) for k, v in sources.items() if k != "python"),
                    torch.are_deterministic_algorithms_enabled(),
                    os.environ.get("PYTHONHASHSEED"), os.environ.get("HCCL_DETERMINISTIC"))

        random.seed(11); np.random.seed(11); torch.manual_seed(11)
        before = world()
        python_before = random.getstate()
        inside, leave = threading.Event(), threading.Event()

        @detctx.deterministic(seed=4)
        def steps():
            inside.set()
            leave.wait()
            yield 1

        def hold():
            if {holder!r} == "nested blocks":
                with detctx.deterministic(seed=1), detctx.deterministic(seed=2):
                    inside.set()
                    leave.wait()
            else:
                next(steps())

        thread = threading.Thread(target=hold)
        thread.start()
        inside.wait()
        assert world() != before  # the other thread's block is in force here
        pid = os.fork()
        if pid == 0:
            ok = world() == before and detctx.open_blocks() == ()
            # Python reseeds `random` in a child, so that it does not repeat its parent.
            fresh = random.getstate() != python_before
            with detctx.deterministic(seed=2):
                pass
            os._exit(0 if ok and fresh and world() == before else 3)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        leave.set()
        thread.join()
        print("parent whole", world() == before and random.getstate() == python_before)
        """,
        timeout=60,
    )
    assert "child exit 0" in output
    assert "parent whole True" in output


@pytest.mark.slow
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
            os._exit(0 if detctx.open_blocks() == () else 5)
        print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        print("parent whole", random.getstate() == before)
        """,
        timeout=60,
    )
    assert "child exit 0" in output
    assert "parent whole True" in output


def test_after_a_fork_inside_a_block_parent_and_child_draw_different_numbers() -> None:
    # Python reseeds `random` in a child; the block's exit put the parent's state back
    # there, so both drew the same numbers after the block.
    output = run_python(
        """
        import os, random, detctx
        random.seed(5)
        with detctx.deterministic(seed=2):
            pid = os.fork()
        draws = [random.random() for _ in range(4)]
        if pid == 0:
            with open(os.environ["DRAWS"], "w") as out:
                out.write(repr(draws))
            os._exit(0)
        os.waitpid(pid, 0)
        with open(os.environ["DRAWS"]) as child:
            print("same", repr(draws) == child.read())
        """,
        env={"DRAWS": str(Path(tempfile.mkdtemp()) / "draws")},
        timeout=60,
    )
    assert "same False" in output


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
