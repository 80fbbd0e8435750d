"""Is there a sound way under NumPy's ``get_state`` / ``set_state`` floor?

NumPy's global legacy generator is a ``RandomState`` over an ``MT19937`` bit
generator. Its full state is the Mersenne Twister's 624-word key and position
*plus* the legacy Gaussian cache (``has_gauss``, ``gauss``), which lives in
the ``RandomState`` and which only ``get_state`` reads and only
``set_state`` / ``seed`` write. ``get_state`` and ``set_state`` are slow
because MT19937's ``state`` property copies the key one element at a time.

Three ways to save, seed and restore it, measured here side by side:

- ``get_state`` / ``seed`` / ``set_state``: the plain way (the floor).
- detctx's way (``detctx._sources.numpy_restore``): ``get_state`` to save (the only
  way to read the Gaussian cache); to restore a state whose cache is empty
  (``has_gauss == 0`` and ``gauss == 0.0``, the usual case), ``seed(0)``
  (which empties the cache) and then copy key and position back into the
  bit generator's C state through its documented ctypes interface
  (``bit_generator.ctypes.state_address``). A state with a cached Gaussian
  falls back to ``set_state``. The C layout (``uint32 key[624]; int pos``)
  is checked once against ``state`` on a private generator; if it ever
  differs, the fast path is not used.
- Raw ctypes save and restore of key and position alone: fastest, and
  **unsound**: it loses the Gaussian cache (shown below by a counterexample).

The fast restore is verified here against ``set_state``: after each, the
``get_state`` tuples are equal and the next draws of several distributions
are identical, for states with and without a cached Gaussian.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.harness import Result, Row, Settings, Table, format_stats, measure, repeated
from detctx._sources import numpy_restore
from detctx._sources.numpy_restore import restore_random_state

SCENARIO = "numpy floor"
SEED = 1234


class _MTState(ctypes.Structure):
    _fields_ = [("key", ctypes.c_uint32 * 624), ("pos", ctypes.c_int)]


def _bit_generator(rng: np.random.RandomState) -> Any:
    return rng._bit_generator


class FastRestore:
    """detctx's NumPy source: ``get_state`` to save, its fast restore to put back."""

    def __init__(self, rng: np.random.RandomState) -> None:
        self._rng = rng

    def capture(self) -> Any:
        return self._rng.get_state()

    def restore(self, state: Any) -> None:
        restore_random_state(self._rng, state)


def _raw_ctypes_roundtrip(rng: np.random.RandomState) -> Callable[[], None]:
    bit_generator = _bit_generator(rng)
    c_state = _MTState.from_address(bit_generator.ctypes.state_address)

    def roundtrip() -> None:
        saved = bytes(c_state)
        rng.seed(SEED)
        ctypes.memmove(ctypes.addressof(c_state), saved, len(saved))

    return roundtrip


def _draws(rng: np.random.RandomState) -> list[Any]:
    return [
        rng.standard_normal(3),
        rng.random_sample(3),
        rng.randint(0, 1000, 3),
        rng.binomial(10, 0.3, 3),
        rng.normal(size=1),
        rng.standard_gamma(2.0, 2),
    ]


def _same(a: list[Any], b: list[Any]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def _states_equal(a: Any, b: Any) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


def verify(cases: int) -> tuple[int, int]:
    """Compare fast restore with ``set_state`` on ``cases`` states; (cases, agreeing)."""
    fast_rng, slow_rng = np.random.RandomState(), np.random.RandomState()
    fast, chooser = FastRestore(fast_rng), np.random.RandomState(5)
    agreeing = 0
    for case in range(cases):
        source = np.random.RandomState(case)
        source.random_sample(int(chooser.randint(0, 2000)))
        if case % 2:  # an odd number of legacy normals leaves a cached Gaussian
            source.standard_normal(int(chooser.randint(0, 5)) * 2 + 1)
        saved = source.get_state()
        for rng in (fast_rng, slow_rng):  # put both somewhere else first
            rng.seed(int(chooser.randint(0, 2**31)))
            rng.standard_normal(int(chooser.randint(1, 4)))
        fast.restore(saved)
        slow_rng.set_state(saved)
        if _states_equal(fast_rng.get_state(), slow_rng.get_state()) and _same(
            _draws(fast_rng), _draws(slow_rng)
        ):
            agreeing += 1
    return cases, agreeing


def raw_ctypes_counterexample() -> bool:
    """True if saving key and position alone loses the Gaussian cache (it does)."""
    rng = np.random.RandomState(SEED)
    rng.standard_normal()  # leaves the second of a pair cached
    expected = np.random.RandomState(SEED)
    expected.standard_normal()
    c_state = _MTState.from_address(_bit_generator(rng).ctypes.state_address)
    saved = bytes(c_state)
    rng.seed(SEED)
    ctypes.memmove(ctypes.addressof(c_state), saved, len(saved))
    return bool(rng.standard_normal() != expected.standard_normal())


def run(settings: Settings) -> Result:
    if not numpy_restore._layout_matches():
        return Result(
            [
                Row(
                    SCENARIO,
                    "fast NumPy restore",
                    None,
                    note="not available: MT19937's C state layout differs in this NumPy",
                )
            ]
        )
    rng = np.random.mtrand._rand
    fast = FastRestore(rng)
    saved = rng.get_state()

    def plain_way() -> None:
        state = rng.get_state()
        rng.seed(SEED)
        rng.set_state(state)

    def fast_way() -> None:
        state = fast.capture()
        rng.seed(SEED)
        fast.restore(state)

    try:
        rng.seed(SEED)  # the global generator without a cached Gaussian: the fast path
        stats = measure(
            {
                "plain": repeated(plain_way),
                "fast": repeated(fast_way),
                "raw": repeated(_raw_ctypes_roundtrip(rng)),
                "get_state": repeated(rng.get_state),
                "set_state": repeated(lambda: rng.set_state(saved)),
                "fast restore": repeated(lambda: fast.restore(saved)),
            },
            settings,
        )
    finally:
        rng.set_state(saved)
    cases, agreeing = verify(40 if settings.quick else 400)
    counterexample = raw_ctypes_counterexample()
    rows = [
        Row(
            SCENARIO,
            "NumPy save+seed+restore, detctx's fast restore",
            stats["fast"],
            "get_state + seed + set_state (the plain way)",
            stats["plain"],
            note=f"sound: equal to set_state in {agreeing}/{cases} checked states",
        ),
        Row(
            SCENARIO,
            "NumPy save+seed+restore, raw ctypes key+pos",
            stats["raw"],
            "get_state + seed + set_state (the plain way)",
            stats["plain"],
            note="UNSOUND: loses the legacy Gaussian cache"
            + (" (counterexample reproduced)" if counterexample else ""),
        ),
    ]
    table = Table(
        "NumPy's global generator: the parts of its floor",
        ["call", "median [IQR]"],
        [
            ["np.random.get_state()", format_stats(stats["get_state"])],
            ["np.random.set_state(state)", format_stats(stats["set_state"])],
            [
                "fast restore (seed(0) + ctypes copy of key and pos)",
                format_stats(stats["fast restore"]),
            ],
        ],
        note=(
            f"Fast restore agreed with set_state in {agreeing} of {cases} states (half of them "
            "with a cached Gaussian, which take the set_state fallback). Saving key and "
            "position alone is unsound: "
            + (
                "a cached Gaussian was lost in the counterexample."
                if counterexample
                else "the counterexample did not reproduce on this NumPy."
            )
        ),
    )
    return Result(rows, [table])
