"""Ctrl-C at any moment leaves no block open, no lock held and no RNG half restored.

CI sends 150 randomly timed SIGINTs (blocks, generator steps, distributed blocks
in a one-rank gloo group) (a few seconds); set
``DETCTX_HAMMER_SIGNALS=6000`` for the full hammering run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import ROOT, TESTS

import detctx
from detctx._state import interrupts


def hammer(script: str, count: int, *options: str) -> tuple[dict[str, Any], str]:
    """Run ``tests/<script> count [options]`` in a child; its JSON report and its stderr."""
    proc = subprocess.run(
        [sys.executable, str(TESTS / script), str(count), *options],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120 + count // 2,  # a few ms a signal; far more on a loaded machine
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.slow
def test_randomly_timed_sigints_in_every_kind_of_block_and_step_corrupt_nothing() -> None:
    signals = int(os.environ.get("DETCTX_HAMMER_SIGNALS", "150"))
    report, errors = hammer("hammer_interrupts.py", signals)
    modes = ("blocks", "generator steps", "distributed blocks")
    assert report == {
        "sent": {mode: len(range(index, signals, len(modes))) for index, mode in enumerate(modes)},
        "corrupted": dict.fromkeys(modes, 0),
        "lock_free": True,
    }
    assert errors == ""


@pytest.mark.slow
def test_thousands_of_blocks_and_generator_steps_leave_no_memory_behind() -> None:
    count = int(os.environ.get("DETCTX_HAMMER_BLOCKS", "500"))
    report, _ = hammer("hammer_memory.py", count)
    assert report["open_blocks"] == 0
    # A leak of one small object per block would be 2 * count * 50 bytes or more per pass.
    # The second pass is measured (one-off allocations fall in the first); it varies by a
    # few KiB run to run without growing with count (python tests/hammer_memory.py 2000).
    assert report["traced_growth_bytes"] < max(16 * 1024, count * 25), report


def test_sigint_s_handler_is_put_back_after_every_block_and_generator() -> None:
    original = signal.getsignal(signal.SIGINT)

    @detctx.deterministic(seed=2)
    def steps() -> Iterator[int]:
        with detctx.deterministic(seed=3):
            yield 1
        yield 2

    with detctx.deterministic(seed=1):
        inside = signal.getsignal(signal.SIGINT)
    assert list(steps()) == [1, 2]
    detctx.restore(detctx.capture())

    assert signal.getsignal(signal.SIGINT) is original
    assert inside is not original  # detctx's, while the block was open


def test_a_handler_the_user_installs_inside_a_block_stays_in_place() -> None:
    original = signal.getsignal(signal.SIGINT)
    calls: list[int] = []
    try:
        with detctx.deterministic(seed=1):
            signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
        signal.raise_signal(signal.SIGINT)
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, original)


def test_an_ignored_sigint_stays_ignored_inside_a_block() -> None:
    original = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with detctx.deterministic(seed=1):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
        assert detctx.open_blocks() == ()
    finally:
        signal.signal(signal.SIGINT, original)


def test_ctrl_c_inside_the_body_is_raised_there_and_the_block_still_restores() -> None:
    before = detctx.fingerprint()
    with pytest.raises(KeyboardInterrupt):
        with detctx.deterministic(seed=1):
            torch.rand(3)
            signal.raise_signal(signal.SIGINT)
            raise AssertionError("KeyboardInterrupt was not raised in the body")
    assert detctx.fingerprint() == before and detctx.open_blocks() == ()


def test_a_handler_a_framework_puts_back_after_a_block_keeps_later_blocks_protected() -> None:
    original = signal.getsignal(signal.SIGINT)
    try:
        with detctx.deterministic(seed=1):
            saved = signal.getsignal(signal.SIGINT)  # a trainer saves detctx's handler
            signal.signal(signal.SIGINT, lambda signum, frame: None)
        signal.signal(signal.SIGINT, saved)  # and puts it back after the block ended

        with detctx.deterministic(seed=2):
            held = interrupts.hold()
            interrupts.let_go(held)

        assert held
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, original)


def test_another_signals_handler_a_framework_puts_back_after_a_block_gives_way_to_its_default(
) -> None:
    # Lightning's signal connector saves the SIGTERM handler it finds when fit starts (detctx's,
    # inside a block) and puts it back after fit: the next block must still enter, and the
    # signal's own default stands for the handler nobody knows any more.
    originals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        with detctx.deterministic(seed=1):
            saved = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, saved)

        with detctx.deterministic(seed=2):
            pass

        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        for signum, handler in originals.items():
            signal.signal(signum, handler)


def test_a_handler_set_between_two_blocks_is_the_one_a_signal_in_the_second_reaches() -> None:
    # Entries reuse the last signal scan while every handler is the one it found: a handler
    # set in between (another function, or the first one put back) must be seen.
    received: list[str] = []
    first = signal.getsignal(signal.SIGUSR1)
    try:
        with detctx.deterministic(seed=1):
            pass
        def one(signum: int, frame: object) -> None:
            received.append("one")

        def two(signum: int, frame: object) -> None:
            received.append("two")

        for handler in (one, two, one):
            signal.signal(signal.SIGUSR1, handler)
            with detctx.deterministic(seed=2):
                assert signal.getsignal(signal.SIGUSR1) is not handler  # detctx's, in force
                signal.raise_signal(signal.SIGUSR1)
            assert signal.getsignal(signal.SIGUSR1) is handler
        assert received == ["one", "two", "one"]
    finally:
        signal.signal(signal.SIGUSR1, first)


def test_the_same_handler_set_again_between_blocks_is_still_handed_each_signal() -> None:
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        received.append(signum)

    first = signal.getsignal(signal.SIGUSR2)
    try:
        for _ in range(3):
            signal.signal(signal.SIGUSR2, handler)
            with detctx.deterministic(seed=3):
                signal.raise_signal(signal.SIGUSR2)
            signal.signal(signal.SIGUSR2, signal.SIG_DFL)
            with detctx.deterministic(seed=3):
                assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # nothing to hold
        assert received == [signal.SIGUSR2] * 3
    finally:
        signal.signal(signal.SIGUSR2, first)
