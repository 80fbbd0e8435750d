"""The one walker over nested values: what is a container, what its children are, and how
to build the same container around new children.

Containers are lists, tuples (``namedtuple`` and ``torch.return_types``
included), mappings (``dict``, ``OrderedDict``, Hugging Face's
``ModelOutput``) and dataclass instances; everything else (tensors, arrays,
numbers, strings, sets) is a leaf. Every place that looks inside a result,
a batch or a captured state uses these three functions, so a namedtuple or
a dataclass works wherever a tuple or a dict does. No torch or NumPy here.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["Kind", "branches", "child_path", "leaves", "map_leaves", "rebuild"]


class Kind(enum.Enum):
    """What kind of container a value is; its children's keys depend on it."""

    LIST = "list"
    TUPLE = "tuple"
    NAMEDTUPLE = "namedtuple"
    MAPPING = "mapping"
    DATACLASS = "dataclass"


def branches(value: object) -> tuple[Kind, list[tuple[Any, Any]]] | None:
    """``(kind, [(key, child), ...])`` for a container, in its own order; ``None`` for a leaf.

    Keys are indices for lists and tuples, field names for namedtuples and
    dataclasses, the mapping's keys for a mapping.
    """
    if isinstance(value, list):
        return Kind.LIST, list(enumerate(value))
    if isinstance(value, tuple):
        fields = getattr(type(value), "_fields", None)
        if isinstance(fields, tuple) and len(fields) == len(value):
            return Kind.NAMEDTUPLE, list(zip(fields, value))
        return Kind.TUPLE, list(enumerate(value))
    if isinstance(value, Mapping):
        return Kind.MAPPING, list(value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return Kind.DATACLASS, [
            (field.name, getattr(value, field.name)) for field in dataclasses.fields(value)
        ]
    return None


def rebuild(value: Any, children: list[Any]) -> Any:
    """A container like ``value`` (its own type) holding ``children``, in ``branches`` order."""
    found = branches(value)
    if found is None:
        raise TypeError(f"{type(value).__name__} is not a container")
    kind, items = found
    if kind is Kind.NAMEDTUPLE:
        return type(value)(*children)
    if kind in (Kind.LIST, Kind.TUPLE):
        # A subclass (torch.Size, torch.return_types.max) takes one iterable as a tuple does.
        return type(value)(children)
    if kind is Kind.MAPPING:
        # A shallow copy keeps the mapping's own type (HF's ModelOutput, an OrderedDict).
        try:
            result = copy.copy(value)
            for (key, _), child in zip(items, children):
                result[key] = child
            return result
        except TypeError:  # a read-only mapping (MappingProxyType): a plain dict instead
            return dict(zip((key for key, _ in items), children))
    result = copy.copy(value)
    for (name, _), child in zip(items, children):
        # object.__setattr__: a frozen dataclass refuses setattr.
        object.__setattr__(result, name, child)
    return result


def map_leaves(function: Callable[[Any], Any], value: Any) -> Any:
    """``value`` with every leaf replaced by ``function(leaf)``, containers rebuilt alike."""
    found = branches(value)
    if found is None:
        return function(value)
    return rebuild(value, [map_leaves(function, child) for _, child in found[1]])


def leaves(value: Any) -> Iterator[Any]:
    """Every leaf of ``value``, depth first, in each container's order."""
    found = branches(value)
    if found is None:
        yield value
        return
    for _, child in found[1]:
        yield from leaves(child)


def child_path(path: str, kind: Kind, key: Any, index: int, show: Callable[[Any], str]) -> str:
    """Where the child ``key`` (at ``index``) of the container at ``path`` is, as Python
    reaches it: ``path[show(key)]`` in a mapping, ``path.key`` in a dataclass,
    ``path[index]`` in a list or a tuple (a namedtuple too, by position)."""
    if kind is Kind.MAPPING:
        return f"{path}[{show(key)}]"
    if kind is Kind.DATACLASS:
        return f"{path}.{key}"
    return f"{path}[{index}]"
