"""Randomly timed SIGINTs against blocks, generator steps and distributed blocks; counts
corruptions.

Run by ``tests/test_interrupts.py`` in a child process (signals and the pytest
process do not mix): ``python tests/hammer_interrupts.py SIGNALS [SIGNAL]`` prints one
JSON line. ``SIGNAL``: ``INT`` (the default), or ``TERM`` / ``USR1``, each with a
handler that raises (``sys.exit(143)``, as a job saving on preemption does; a
``RuntimeError``). Each signal is sent by a helper thread at a random moment; the
main thread catches the ``KeyboardInterrupt`` wherever it lands and checks
that no block is open, the lock is free, and every RNG, flag and variable
is what it was before.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import torch
from helpers import DETERMINISM_ENV, generator_steps, mindspeed_seed

import detctx
from detctx._blocks import stack as block_stack


def world() -> tuple[object, ...]:
    flags = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    return detctx.fingerprint(), flags, tuple(os.environ.get(name) for name in DETERMINISM_ENV)


def lock_is_free() -> bool:
    done = threading.Event()

    def enter() -> None:
        with detctx.deterministic(seed=0):
            done.set()

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    entered = done.wait(10)
    if entered:
        # Still in the block's exit (in torch's C++): a daemon thread there when the
        # interpreter shuts down is unwound by pthread_exit, and C++ aborts ("terminate
        # called without an active exception").
        thread.join(10)
    return entered


def blocks() -> None:
    while True:
        with detctx.deterministic(seed=1):
            np.random.rand()
            with detctx.deterministic(seed=2):
                random.random()


def distributed_blocks() -> None:
    # verify=True adds the entry and exit checks; in a group of one they gather nothing.
    while True:
        with detctx.distributed_deterministic(seed=3, verify=True):
            np.random.rand()
            with detctx.distributed_deterministic(seed=4, per_rank=True):
                random.random()


MODES = {
    "blocks": blocks,
    "generator steps": generator_steps,
    "distributed blocks": distributed_blocks,
}


def one_rank_group() -> None:
    """A gloo group of one rank, as ``torchrun --nproc-per-node 1`` would make."""
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)


class Usr1(RuntimeError):
    """What the SIGUSR1 handler raises."""


def _raise_usr1(signum: int, frame: object) -> None:
    raise Usr1("SIGUSR1")


HANDLERS = {
    "INT": None,  # Python's own: KeyboardInterrupt
    "TERM": lambda signum, frame: sys.exit(143),
    "USR1": _raise_usr1,
}


def main(signals: int, name: str = "INT") -> None:
    signum = getattr(signal, f"SIG{name}")
    if HANDLERS[name] is not None:
        signal.signal(signum, HANDLERS[name])
    one_rank_group()
    mindspeed_seed(123)
    baseline = world()
    timing = random.Random(99)
    armed = threading.Event()
    stop = False

    def shoot() -> None:
        while True:
            armed.wait()
            armed.clear()
            if stop:
                return
            time.sleep(timing.uniform(0, 0.002))
            os.kill(os.getpid(), signum)

    shooter = threading.Thread(target=shoot, daemon=True)
    shooter.start()
    lost = dict.fromkeys(MODES, 0)
    sent = dict.fromkeys(MODES, 0)
    for index in range(signals):
        mode = list(MODES)[index % len(MODES)]
        run = MODES[mode]
        try:
            armed.set()
            run()
        except (KeyboardInterrupt, SystemExit, Usr1):
            pass
        sent[mode] += 1
        if detctx.open_blocks() or block_stack.entered_here() or world() != baseline:
            lost[mode] += 1
            print(f"corrupted after signal {index} ({mode})", file=sys.stderr)
            mindspeed_seed(123)
        if index % 500 == 0 and not lock_is_free():
            lost[mode] += 1
            print(f"lock held after signal {index} ({mode})", file=sys.stderr)
            break
    stop = True
    armed.set()
    # A shot may still be on its way (armed for the last run, which ended first), and a
    # signal detctx held may be sent back a millisecond later: both land here, not while
    # the interpreter shuts down, where SIGINT's default action would kill the process.
    settled = time.monotonic() + 0.05
    while True:
        try:
            shooter.join(0.01)
            if not shooter.is_alive() and time.monotonic() >= settled:
                break
        except (KeyboardInterrupt, SystemExit, Usr1):
            pass
    print(json.dumps({"sent": sent, "corrupted": lost, "lock_free": lock_is_free()}))


if __name__ == "__main__":
    main(int(sys.argv[1]), *sys.argv[2:3])
