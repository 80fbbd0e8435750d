"""One rule for "the same number", used wherever detctx compares results or curves.

Two floats are the same when their bits are the same, except that every NaN
equals every NaN: ``-0.0`` differs from ``0.0`` (a sign flip is a real
difference in a reduction), while NaN payloads, which kernels do not keep
stable, do not count. :func:`detctx.check_reproducible` applies the same rule
element by element to tensors and arrays.
"""

from __future__ import annotations

import math
import struct

__all__ = ["same_float"]


def same_float(a: float, b: float) -> bool:
    """Bit-for-bit float equality, except that every NaN equals every NaN."""
    if math.isnan(a) and math.isnan(b):
        return True
    return struct.pack("<d", a) == struct.pack("<d", b)
