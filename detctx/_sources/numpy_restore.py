"""Restoring a NumPy ``RandomState`` faster than ``set_state``, soundly.

A legacy ``RandomState`` over ``MT19937`` holds the Mersenne Twister's key and
position *and* a cached second Gaussian (``has_gauss``, ``gauss``) that only
``get_state`` reads and only ``set_state`` / ``seed`` write. ``set_state`` is
slow (about 45 us) because MT19937's ``state`` setter copies the 624-word key
element by element.

For the usual state, whose Gaussian cache is empty, the same result comes from
``seed(0)`` (which empties the cache and resets the other cached values) and
then copying key and position into the bit generator's C state through its
documented ctypes interface (``bit_generator.ctypes.state_address``): about
7 us. Any other state falls back to ``set_state``. The C layout
(``uint32 key[624]; int pos``) is checked once against ``.state`` on a private
generator; if it ever differs, the fast path is never used.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from detctx._basics import process_cache

__all__ = ["restore_random_state"]

_KEY_WORDS = 624


class _MT19937State(ctypes.Structure):
    _fields_ = [("key", ctypes.c_uint32 * _KEY_WORDS), ("pos", ctypes.c_int)]


def _layout_matches() -> bool:
    try:
        probe = np.random.RandomState(987)
        probe.random_sample(1001)
        bit_generator = probe._bit_generator
        c_state = _MT19937State.from_address(bit_generator.ctypes.state_address)
        expected = bit_generator.state["state"]
        key = np.frombuffer(bytes(c_state.key), dtype=np.uint32)
        return bool(np.array_equal(key, expected["key"]) and c_state.pos == expected["pos"])
    except Exception:  # any surprise in a NumPy build: keep to set_state
        return False


_fast_path: bool | None = None


@process_cache
def _forget_layout() -> None:
    # The layout check is redone against the NumPy loaded now.
    global _fast_path
    _fast_path = None


def _check_position(state: Any) -> None:
    """Refuse an ``MT19937`` position outside ``[0, 624]`` before NumPy sees it.

    NumPy's own ``set_state`` takes any position; the next draw then reads
    past the key, and ``2**31 - 1`` crashes the process (see
    :mod:`detctx._sources.checks`).
    """
    if isinstance(state, tuple) and len(state) >= 3 and state[0] == "MT19937":
        pos = state[2]
    elif isinstance(state, dict) and state.get("bit_generator") == "MT19937":
        inner = state.get("state")
        pos = inner.get("pos") if isinstance(inner, dict) else None
    else:
        return
    valid = isinstance(pos, (int, np.integer)) and not isinstance(pos, bool)
    if not valid or not 0 <= pos <= _KEY_WORDS:
        raise ValueError(
            f"refusing a NumPy MT19937 state with position {pos!r}: it must be an int in "
            f"[0, {_KEY_WORDS}] (a corrupted or crafted state)"
        )


def restore_random_state(rng: np.random.RandomState, state: Any) -> None:
    """``rng.set_state(state)``, taking the fast path where it is provably the same.

    A ``MT19937`` position outside ``[0, 624]`` raises ``ValueError`` with
    ``rng`` left unchanged.
    """
    global _fast_path
    _check_position(state)
    if _fast_path is None:
        _fast_path = _layout_matches()
    if (
        _fast_path
        and isinstance(state, tuple)
        and len(state) == 5
        and state[0] == "MT19937"
        and state[3] == 0
        and state[4] == 0.0
    ):
        key = state[1]
        bit_generator = rng._bit_generator
        if (
            isinstance(key, np.ndarray)
            and key.dtype == np.uint32
            and key.shape == (_KEY_WORDS,)
            and key.flags.c_contiguous
            and isinstance(bit_generator, np.random.MT19937)
        ):
            rng.seed(0)  # empties the Gaussian cache; key and position are overwritten next
            c_state = _MT19937State.from_address(bit_generator.ctypes.state_address)
            ctypes.memmove(c_state.key, key.ctypes.data, _KEY_WORDS * 4)
            c_state.pos = int(state[2])
            return
    rng.set_state(state)
