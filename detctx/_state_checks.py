"""Checks that a state read from a checkpoint is one its source can take.

A checkpoint is untrusted input: a crafted or corrupted RNG state dict must be
refused before any RNG is touched, not half-applied or, worse, applied. Some
values the RNG libraries accept silently are wrong or dangerous:

- NumPy's ``MT19937`` state setter takes any ``pos``; a ``pos`` past 624 makes
  the next draws read memory beyond the key, and ``2**31 - 1`` crashes the
  process (``python -c "import numpy as np; r = np.random.RandomState(0);
  s = list(r.get_state()); s[2] = 2**31 - 1; r.set_state(tuple(s));
  r.random_sample(10)"`` dies with SIGSEGV).
- ``random.setstate`` truncates words of ``2**40`` to 32 bits; torch's
  generators take a state tensor and normalise what they do not like.

Each check raises :class:`InvalidField` naming the field; the state dict
reader turns it into a :class:`~detctx.CheckpointError` naming the
source as well.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import torch

__all__ = [
    "InvalidField",
    "check_accelerator",
    "check_bit_generator",
    "check_numpy_legacy",
    "check_pending_seed",
    "check_python",
    "check_torch",
    "check_words",
]

MT_WORDS: Final = 624
"""The Mersenne Twister's key length; its position runs from 0 to this value."""


class InvalidField(ValueError):
    """A field of a saved RNG state holds a value its source must not be given."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def check_words(words: np.ndarray[Any, Any], field: str, count: int) -> None:
    """``words`` holds ``count`` integers in ``[0, 2**32)``."""
    if words.shape != (count,):
        raise InvalidField(field, f"must hold {count} words, not {words.shape}")
    if words.size and (int(words.min()) < 0 or int(words.max()) >= 2**32):
        bad = int(words[(words < 0) | (words >= 2**32)][0])
        raise InvalidField(field, f"words must be in [0, 2**32), found {bad}")


def _check_int(value: object, field: str, low: int, high: int) -> int:
    if type(value) is not int:
        raise InvalidField(field, f"must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidField(field, f"must be in [{low}, {high}], not {value}")
    return value


def _check_finite(value: object, field: str) -> None:
    if type(value) is not float or not math.isfinite(value):
        raise InvalidField(field, f"must be a finite float, not {value!r}")


def check_python(version: object, internal: np.ndarray[Any, Any], gauss_next: object) -> None:
    """A ``random.Random`` state: version 3, 624 key words and a position, a cached Gaussian."""
    _check_int(version, "version", 3, 3)
    if internal.shape != (MT_WORDS + 1,):
        raise InvalidField("internal", f"must hold {MT_WORDS + 1} words, not {internal.shape}")
    check_words(internal[:MT_WORDS], "internal", MT_WORDS)
    _check_int(int(internal[MT_WORDS]), "internal[624] (position)", 0, MT_WORDS)
    if gauss_next is not None:
        _check_finite(gauss_next, "gauss_next")


def check_numpy_legacy(
    bit_generator: object, pos: object, has_gauss: object, cached_gaussian: object
) -> None:
    """A legacy ``RandomState`` tuple's fields other than the key (see :func:`check_words`)."""
    if bit_generator != "MT19937":
        raise InvalidField("bit_generator", f"must be 'MT19937', not {bit_generator!r}")
    _check_int(pos, "pos", 0, MT_WORDS)
    _check_int(has_gauss, "has_gauss", 0, 1)
    _check_finite(cached_gaussian, "cached_gaussian")


def check_bit_generator(state: Any, target: np.random.BitGenerator) -> None:
    """A NumPy bit generator ``state`` dict fits ``target``'s type, as it will be read back.

    It is tried on a fresh bit generator of the same type, which must give
    back exactly what it was given (NumPy reduces some values silently).
    """
    expected = type(target).__name__
    if not isinstance(state, Mapping):
        raise InvalidField("state", f"must be a state dict, not {type(state).__name__}")
    if state.get("bit_generator") != expected:
        raise InvalidField(
            "bit_generator", f"is {state.get('bit_generator')!r}; this source's is {expected!r}"
        )
    if expected == "MT19937":
        inner = state.get("state")
        if not isinstance(inner, Mapping) or not isinstance(inner.get("key"), np.ndarray):
            raise InvalidField("state", "must hold a 'key' array and a 'pos'")
        check_words(inner["key"], "state.key", MT_WORDS)
        _check_int(inner.get("pos"), "state.pos", 0, MT_WORDS)
    scratch = type(target)()
    try:
        scratch.state = dict(state)
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise InvalidField("state", f"refused by NumPy ({type(exc).__name__}: {exc})") from exc
    if not _same(scratch.state, state):
        raise InvalidField("state", f"holds values out of range for {expected}")


def check_torch(state: torch.Tensor, scratch: torch.Generator, field: str = "state") -> None:
    """A torch generator state tensor, tried on ``scratch``: it must be taken as it is."""
    try:
        scratch.set_state(state)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidField(field, f"refused by torch ({exc})") from exc
    if not torch.equal(scratch.get_state(), state):
        raise InvalidField(field, "holds values torch does not keep as given (corrupted?)")


def check_accelerator(states: tuple[torch.Tensor, ...], current: object) -> None:
    """One state tensor per device, each the size of that device's present state.

    ``current`` is the device type's captured state now (a tuple of tensors
    when it is initialised; anything else when it is not, and cannot be read).
    """
    for index, state in enumerate(states):
        if state.dim() != 1 or not state.numel():
            raise InvalidField(f"devices[{index}]", "must be a non-empty 1-D uint8 tensor")
    if isinstance(current, tuple):
        for index, (state, now) in enumerate(zip(states, current)):
            if isinstance(now, torch.Tensor) and state.shape != now.shape:
                raise InvalidField(
                    f"devices[{index}]",
                    f"holds {state.numel()} bytes; the device's state has {now.numel()}",
                )


def check_pending_seed(seed_before: object) -> None:
    """A seed pending for an uninitialised device: an int in ``[0, 2**64)``."""
    _check_int(seed_before, "seed_before", 0, 2**64 - 1)


def _same(left: Any, right: Any) -> bool:
    """Whether two bit generator states are equal, arrays element for element."""
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        return left.keys() == right.keys() and all(_same(left[k], right[k]) for k in left)
    if isinstance(left, np.ndarray) or isinstance(right, np.ndarray):
        return (
            isinstance(left, np.ndarray)
            and isinstance(right, np.ndarray)
            and left.shape == right.shape
            and bool(np.array_equal(left, right))
        )
    return isinstance(left, bool) == isinstance(right, bool) and bool(left == right)
