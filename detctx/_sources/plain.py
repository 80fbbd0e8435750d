"""Plain data: what ``torch.load(..., weights_only=True)`` brings back without an allow-list.

Tensors, ints, floats, strings, ``None``, lists, tuples and dicts with string
keys. Each RNG source turns its captured state into plain data for a
checkpoint (:class:`~detctx._sources.registry.Checkpointable`) with these helpers, and
back, checking every value on the way in (:mod:`detctx._sources.checks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import torch

__all__ = ["array_from_plain", "array_to_plain", "problem", "tensor"]

_ARRAY_TAG: Final = "__ndarray__"


def tensor(value: Any, dtype: torch.dtype) -> torch.Tensor:
    """``value`` if it is a tensor of ``dtype``, else ``TypeError``."""
    if not isinstance(value, torch.Tensor) or value.dtype != dtype:
        raise TypeError(f"expected a {dtype} tensor, got {type(value).__name__}")
    return value


def array_to_plain(value: Any) -> Any:
    """NumPy data (nested dicts of ints and arrays, as bit generator states are) as plain data."""
    if isinstance(value, dict):
        return {str(key): array_to_plain(item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        contiguous = np.ascontiguousarray(value)
        return {
            _ARRAY_TAG: contiguous.dtype.str,
            "shape": list(contiguous.shape),
            "data": torch.from_numpy(contiguous.reshape(-1).view(np.uint8).copy()),
        }
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def array_from_plain(value: Any) -> Any:
    """The inverse of :func:`array_to_plain` (shapes and dtypes as stored: check them)."""
    if isinstance(value, Mapping):
        if _ARRAY_TAG in value:
            data = tensor(value["data"], torch.uint8).numpy().tobytes()
            array = np.frombuffer(data, dtype=np.dtype(value[_ARRAY_TAG]))
            return array.reshape(tuple(value["shape"])).copy()
        return {key: array_from_plain(item) for key, item in value.items()}
    return value


def problem(value: Any, where: str = "state") -> str | None:
    """Where ``value`` holds something ``torch.load(weights_only=True)`` rejects, or None."""
    if isinstance(value, np.generic):
        # np.float64 subclasses float, yet is pickled as a NumPy object.
        return f"a NumPy scalar ({type(value).__name__}) at {where}"
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = problem(item, f"{where}[{index}]")
            if found is not None:
                return found
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"a non-string key {key!r} in {where}"
            found = problem(item, f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    return f"a {type(value).__module__}.{type(value).__qualname__} at {where}"
