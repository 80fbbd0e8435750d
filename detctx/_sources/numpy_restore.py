"""Capturing and restoring a NumPy ``RandomState`` faster than ``get_state`` and
``set_state``, soundly.

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

``get_state`` takes about 45 us, most of a block's own cost: it builds the
state dict of MT19937 and converts it. The same tuple comes from the key and
position read through the same ctypes interface and the Gaussian cache read
from the ``RandomState`` object itself, where NumPy's ``mtrand.pyx`` keeps it
(``aug_bitgen_t _aug_state``, just after the ``bitgen_t _bitgen`` whose first
field points at the bit generator's C state). Where that is in the object is
found once on a private generator (the pointer to the C state, then the
``_aug_state`` whose first field points back at ``_bitgen``) and checked
against ``get_state`` after Gaussian draws that fill and empty the cache; where
anything differs, ``get_state`` is used. About 3 us.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from detctx._basics import process_cache

__all__ = ["capture_random_state", "restore_random_state"]

_KEY_WORDS = 624
_POINTER = ctypes.sizeof(ctypes.c_void_p)
_BITGEN_FIELDS = 5  # bitgen_t: the state pointer and four function pointers


class _MT19937State(ctypes.Structure):
    _fields_ = [("key", ctypes.c_uint32 * _KEY_WORDS), ("pos", ctypes.c_int)]


class _AugState(ctypes.Structure):
    """NumPy's ``aug_bitgen_t``: the ``bitgen_t`` it draws from and the Gaussian cache."""

    _fields_ = [
        ("bit_generator", ctypes.c_void_p),
        ("has_gauss", ctypes.c_int),
        ("gauss", ctypes.c_double),
    ]


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


def _gauss_offset() -> int | None:
    """Where a ``RandomState`` keeps its ``_aug_state``, from the object's start, or
    ``None`` where it is not found exactly as described above."""
    try:
        probe = np.random.RandomState(987)
        address, size = id(probe), type(probe).__basicsize__
        state_address = probe._bit_generator.ctypes.state_address
        found = None
        for offset in range(0, size - ctypes.sizeof(_AugState), _POINTER):
            if ctypes.c_void_p.from_address(address + offset).value != state_address:
                continue
            aug_offset = offset + _BITGEN_FIELDS * _POINTER
            if aug_offset + ctypes.sizeof(_AugState) > size:
                break
            if _AugState.from_address(address + aug_offset).bit_generator == address + offset:
                found = aug_offset
                break
        if found is None:
            return None
        for draws in (1, 1, 2, 3):  # the cache filled, emptied, emptied, filled
            probe.standard_normal(draws)
            _, _, _, has_gauss, gauss = probe.get_state()
            aug = _AugState.from_address(address + found)
            if (aug.has_gauss, aug.gauss) != (has_gauss, gauss):
                return None
        return found if has_gauss else None
    except Exception:  # any surprise in a NumPy build: keep to get_state
        return None


_fast_path: bool | None = None
_aug_offset: int | None = None
_aug_looked = False


@process_cache
def _forget_layout() -> None:
    # The layout checks are redone against the NumPy loaded now.
    global _fast_path, _aug_looked
    _fast_path = None
    _aug_looked = False


def capture_random_state(rng: np.random.RandomState) -> Any:
    """``rng.get_state()``, read directly where that is provably the same (see above)."""
    global _fast_path, _aug_offset, _aug_looked
    if _fast_path is None:
        _fast_path = _layout_matches()
    if not _aug_looked:
        _aug_offset, _aug_looked = _gauss_offset(), True
    bit_generator = rng._bit_generator
    if (
        not _fast_path
        or _aug_offset is None
        or type(rng) is not np.random.RandomState
        or type(bit_generator) is not np.random.MT19937
    ):
        return rng.get_state()
    # Without the RandomState's lock (a C-level attribute): a thread drawing from it
    # while a block enters races with the block whichever way the state is read.
    c_state = _MT19937State.from_address(bit_generator.ctypes.state_address)
    key = np.frombuffer(bytes(c_state.key), dtype=np.uint32).copy()
    aug = _AugState.from_address(id(rng) + _aug_offset)
    return ("MT19937", key, int(c_state.pos), int(aug.has_gauss), float(aug.gauss))


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
