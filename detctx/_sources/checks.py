"""Checks that a state read from a checkpoint is one its source can take.

A checkpoint is untrusted input: a crafted or corrupted RNG state dict must be
refused before any RNG is touched, not half-applied or, worse, applied. Some
values the RNG libraries accept silently are wrong or dangerous:

- NumPy's ``MT19937`` state setter takes any ``pos``; a ``pos`` past 624 makes
  the next draws read memory beyond the key, and ``2**31 - 1`` crashes the
  process (``python -c "import numpy as np; r = np.random.RandomState(0);
  s = list(r.get_state()); s[2] = 2**31 - 1; r.set_state(tuple(s));
  r.random_sample(10)"`` dies with SIGSEGV).
- NumPy's other bit generators take other fields unchecked: a Philox
  ``buffer_pos`` below 0 reads memory before its buffer, and far below crashes
  (see :func:`check_bit_generator`).
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
    "check_fields",
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


def check_fields(stored: object, *names: str) -> Mapping[str, Any]:
    """``stored`` as a dict holding each of ``names`` (a state stored as a dict of fields):
    a tensor, a list or a string in its place is refused before anything reads it."""
    if not isinstance(stored, Mapping):
        raise InvalidField(
            "state", f"must be a dict of {', '.join(names)}, not a {type(stored).__name__}"
        )
    missing = [name for name in names if name not in stored]
    if missing:
        raise InvalidField(", ".join(missing), "missing from the state")
    return stored


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


# What each bit generator's state dict holds, field by field: NumPy's state
# setters take most of these values unchecked. A Philox ``buffer_pos`` of
# -10**8 crashes the next draw (SIGSEGV), -1 draws memory before the buffer:
#   python -c "import numpy as np; b = np.random.Philox(1); s = b.state;
#   s['buffer_pos'] = -10**8; b.state = s; np.random.Generator(b).random(3)"
# Arrays of the wrong dtype are converted silently (a float counter is
# truncated), arrays longer than the C state are cut, an even PCG64 increment
# gives a degenerate stream and ``has_uint32`` takes any int.
_U64: Final = np.dtype(np.uint64)
_BUFFERED: Final = {"has_uint32": (0, 1), "uinteger": (0, 2**32 - 1)}
_ARRAYS: Final[dict[str, dict[str, tuple[np.dtype[Any], int]]]] = {
    "MT19937": {"state.key": (np.dtype(np.uint32), MT_WORDS)},
    "PCG64": {},
    "PCG64DXSM": {},
    "Philox": {"state.counter": (_U64, 4), "state.key": (_U64, 2), "buffer": (_U64, 4)},
    "SFC64": {"state.state": (_U64, 4)},
}
_INTS: Final[dict[str, dict[str, tuple[int, int]]]] = {
    "MT19937": {"state.pos": (0, MT_WORDS)},
    "PCG64": {"state.state": (0, 2**128 - 1), "state.inc": (1, 2**128 - 1), **_BUFFERED},
    "Philox": {"buffer_pos": (0, 4), **_BUFFERED},
    "SFC64": {**_BUFFERED},
}
_INTS["PCG64DXSM"] = _INTS["PCG64"]
_GAUSS: Final = frozenset({"has_gauss", "gauss"})
"""What a ``RandomState`` adds to its bit generator's state (a cached Gaussian)."""


def check_bit_generator(state: Any, target: np.random.BitGenerator) -> None:
    """A NumPy bit generator ``state`` dict fits ``target``'s type, field by field.

    Covers MT19937, PCG64, PCG64DXSM, Philox and SFC64: every field is
    present, of its exact type (arrays of their exact dtype and length) and in
    range, and nothing else is there, except the ``has_gauss`` and ``gauss``
    a ``RandomState`` adds. A state for any other bit generator type is
    refused: detctx cannot tell which of its values are safe. Last, the state
    is tried on a fresh bit generator of the same type, which must give back
    exactly what it was given.
    """
    expected = type(target).__name__
    if type(target) is not getattr(np.random, expected, None) or expected not in _ARRAYS:
        raise InvalidField(
            "bit_generator",
            f"detctx cannot check a {type(target).__module__}.{type(target).__qualname__} "
            f"state, so it does not restore one from a checkpoint (it checks "
            f"{', '.join(_ARRAYS)})",
        )
    if not isinstance(state, Mapping):
        raise InvalidField("state", f"must be a state dict, not {type(state).__name__}")
    if state.get("bit_generator") != expected:
        raise InvalidField(
            "bit_generator", f"is {state.get('bit_generator')!r}; this source's is {expected!r}"
        )
    arrays, ints = _ARRAYS[expected], _INTS[expected]
    _check_layout(state, {"bit_generator", *arrays, *ints}, expected)
    for field, (dtype, count) in arrays.items():
        value = _field(state, field)
        if not isinstance(value, np.ndarray) or value.dtype != dtype:
            found = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise InvalidField(field, f"must be a {dtype} array, not {found}")
        if value.shape != (count,):
            raise InvalidField(field, f"must hold {count} words, not {value.shape}")
    for field, (low, high) in ints.items():
        _check_int(_plain_int(_field(state, field)), field, low, high)
    if expected.startswith("PCG64") and not _field(state, "state.inc") % 2:
        raise InvalidField("state.inc", "must be odd (every PCG64 stream's increment is)")
    if _GAUSS <= state.keys():
        _check_int(_plain_int(state["has_gauss"]), "has_gauss", 0, 1)
        _check_finite(state["gauss"], "gauss")
    bare = {key: value for key, value in state.items() if key not in _GAUSS}
    scratch = type(target)()
    try:
        scratch.state = bare
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise InvalidField("state", f"refused by NumPy ({type(exc).__name__}: {exc})") from exc
    if not _same(scratch.state, bare):
        raise InvalidField("state", f"holds values out of range for {expected}")


def _check_layout(state: Mapping[str, Any], fields: set[str], kind: str) -> None:
    """``state`` has exactly ``fields`` (dotted names reach into ``state``), gauss aside."""
    inner = state.get("state")
    if not isinstance(inner, Mapping):
        raise InvalidField("state", f"must be a dict, not {type(inner).__name__}")
    outer = {field for field in fields if "." not in field} | {"state"}
    nested = {field.partition(".")[2] for field in fields if "." in field}
    gauss = _GAUSS & state.keys()
    for where, have, want in (("", set(state) - gauss, outer), ("state.", set(inner), nested)):
        if have != want:
            missing = [where + name for name in sorted(want - have)]
            extra = [where + name for name in sorted(map(str, have - want))]
            problems = [f"lacks {', '.join(missing)}"] if missing else []
            problems += [f"holds unknown {', '.join(extra)}"] if extra else []
            raise InvalidField("layout", f"a {kind} state {' and '.join(problems)}")
    if gauss and gauss != _GAUSS:
        raise InvalidField("layout", "has_gauss and gauss come together or not at all")


def _field(state: Mapping[str, Any], field: str) -> Any:
    outer, _, inner = field.partition(".")
    return state[outer][inner] if inner else state[outer]


def _plain_int(value: object) -> object:
    """NumPy integers as ints, so that :func:`_check_int` judges their value."""
    return int(value) if isinstance(value, np.integer) else value


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
