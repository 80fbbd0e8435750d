"""An op's scalar arguments: recorded as text beside its values, compared between two runs.

The arguments that are plain numbers or strings (a norm's ``eps``, dropout's ``p``, an
``alpha``, GELU's ``approximate``) are what a value compare may not show: a changed eps
can move a norm's output less than the tolerance. They are kept as ``name=value`` (the
schema's names, ``repr`` of the value), and a paired op called with another one is an
origin, with what differs said; floats within the float32 tolerance of each other are the
same (a scale computed another way on another machine).
"""

from __future__ import annotations

import math
from typing import Any, Final

__all__ = ["scalar_arguments", "scalar_difference", "scalar_numbers"]

_SCALARS: Final = (float, int, bool, complex, str)
_argument_names: dict[Any, tuple[str, ...]] = {}


def scalar_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The op's arguments that are plain numbers or strings (a norm's ``eps``, dropout's
    ``p``, an ``alpha``, GELU's ``approximate``), as ``name=value`` joined by ``", "``:
    what a compare shows and compares beside the values (``""`` for none)."""
    names = _argument_names.get(func)
    if names is None:
        names = _argument_names[func] = tuple(a.name for a in func._schema.arguments)
    parts = [f"{name}={value!r}" for name, value in zip(names, args) if type(value) in _SCALARS]
    if kwargs:
        parts += [f"{name}={value!r}" for name, value in kwargs.items() if type(value) in _SCALARS]
    return ", ".join(parts)


def _arguments(text: str) -> dict[str, str]:
    pairs = (part.partition("=") for part in text.split(", ") if part)
    return {name: value for name, _, value in pairs}


def scalar_numbers(text: str) -> dict[str, float]:
    """The numeric arguments of a recorded op's scalar text, by name (``value=-0.01`` ->
    ``{"value": -0.01}``); strings and anything unreadable are left out."""
    numbers = {}
    for name, value in _arguments(text).items():
        try:
            numbers[name] = float(value)
        except ValueError:
            continue
    return numbers


def scalar_difference(text_a: str, text_b: str, rtol: float) -> str | None:
    """What differs between two ops' scalar arguments (as the recorder writes them), or
    ``None`` when only floats differ, each within ``rtol`` of the larger."""
    given_a, given_b = _arguments(text_a), _arguments(text_b)
    differing = []
    for name in dict.fromkeys([*given_a, *given_b]):
        value_a, value_b = given_a.get(name), given_b.get(name)
        if value_a == value_b:
            continue
        if value_a is not None and value_b is not None:
            try:
                number_a, number_b = float(value_a), float(value_b)
            except ValueError:
                number_a = number_b = math.nan
            scale = max(abs(number_a), abs(number_b))
            floats = "." in value_a + value_b or "e" in value_a + value_b  # not ints
            if floats and math.isfinite(scale) and abs(number_a - number_b) <= rtol * scale:
                continue
        differing.append(f"{name} {value_a or '(not given)'} in A, {value_b or '(not given)'} in B")
    return "; ".join(differing) if differing else None
