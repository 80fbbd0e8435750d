"""How much error an op's inputs can explain, bounded per kind of op from the statistics
two traces keep.

An op past tolerance is an origin when its own error is more than its inputs explain.
For element-wise arithmetic, sums and matrix products the bound is first-order error
propagation, worked out from what each value's row holds: its norm, its smallest and
largest value, its element count, and (compared with the partner) its absolute error
``||a - b||``. For ``y = x / d`` per element ``|dy| <= |dx| / |d| + |y| |dd| / |d|``, so
over the tensor ``||dy|| <= ||dx|| / min|d| + ||y|| ||dd|| / ||d||`` (the divisor's term
taken as relative: a divisor's rounding is relative to its elements); for a sum of ``k``
elements into each output ``||dy|| <= sqrt(k) ||dx||`` whatever cancels; for ``A @ B``,
``||dA|| ||B|| + ||A|| ||dB||``; likewise AdamW's ``addcdiv``/``addcmul``/``lerp`` and
the smooth activations (:data:`KINDS`). The bound holds whichever elements carry the
error, so it is loose where a divisor is tiny or a sum cancels, as it should be: AdamW's
update of a parameter whose gradient is zero but for rounding divides that rounding by
``eps`` and moves the parameter by a full step, from inputs whose error is 5e-7 of their
norm; the bound (``1e-2 * ||d exp_avg|| / 1e-8``) explains it, where a fixed growth
factor called it an origin. Where no divisor is small and nothing cancels the bound is
tight, so a real change there is an origin even when its inputs carry noise of a
hundredth of its size. An input broadcast to the output's shape counts
``sqrt(n_out / n_in)`` times.

Each op also rounds on its own (another kernel, another vector width): a few units in
the last place of its output (:data:`OWN_ROUNDING`; a product's grows with the square
root of its sums' length). Ops of other kinds (normalisations, convolutions, ``sqrt``,
whose error depends on what the statistics do not show) and ops reading data whose
statistics are not known get no bound: :mod:`detctx._compare.origins` falls back to its
growth rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = ["KINDS", "OWN_ROUNDING", "Value", "explained_error", "kind_of"]

OWN_ROUNDING: Final = 8.0
"""Units in the last place (of the output's dtype, over its norm) an op's own rounding may
differ by between kernels."""
_UNIT: Final = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


@dataclass(frozen=True)
class Value:
    """What the traces say of one value: its absolute error against the partner
    (``||a - b||``), and B's norm, smallest and largest value and element count."""

    error: float
    norm: float
    low: float
    high: float
    count: float
    shape: tuple[int, ...] = ()
    dtype: str = "float32"

    @property
    def largest(self) -> float:
        return max(abs(self.low), abs(self.high))

    @property
    def smallest(self) -> float:
        """The smallest magnitude: 0 when the values take both signs."""
        if self.low > 0:
            return self.low
        if self.high < 0:
            return -self.high
        return 0.0


_Bound = Callable[[Sequence[Value], Value, dict[str, float]], float | None]


def _spread(value: Value, out: Value) -> float:
    """An input's error as it reaches the output: broadcast, each element is read
    ``n_out / n_in`` times."""
    if value.count <= 0 or out.count <= value.count:
        return value.error
    return value.error * math.sqrt(out.count / value.count)


def _quotient(error: float, divisor: float) -> float:
    if error == 0.0:
        return 0.0
    return math.inf if divisor <= 0.0 else error / divisor


def _relative(divisor: Value) -> float:
    """A divisor's error, as the relative error it gives a quotient: its norm's share. The
    worst case (all of it at the smallest divisor) is not taken here: a divisor's rounding
    is relative to its elements, and the tiny divisors that amplify (AdamW's ``eps``) do
    it through the numerator's term."""
    if divisor.error == 0.0:
        return 0.0
    return math.inf if divisor.norm == 0.0 else divisor.error / divisor.norm


def _sum(inputs: Sequence[Value], out: Value, scalars: dict[str, float]) -> float | None:
    if not 1 <= len(inputs) <= 2:
        return None
    # Either input may be the one ``alpha`` scales (``rsub``): both count it.
    alpha = max(abs(scalars.get("alpha", 1.0)), 1.0)
    return alpha * sum(_spread(value, out) for value in inputs)


def _product(inputs: Sequence[Value], out: Value, scalars: dict[str, float]) -> float | None:
    if len(inputs) == 1:
        return abs(scalars.get("other", math.nan)) * inputs[0].error
    if len(inputs) != 2:
        return None
    x, y = inputs
    dx, dy = _spread(x, out), _spread(y, out)
    return y.largest * dx + x.largest * dy + dx * dy


def _quotient_op(inputs: Sequence[Value], out: Value, scalars: dict[str, float]) -> float | None:
    if len(inputs) == 1:
        return _quotient(inputs[0].error, abs(scalars.get("other", math.nan)))
    if len(inputs) != 2:
        return None
    x, d = inputs
    return _quotient(_spread(x, out), d.smallest) + out.norm * _relative(d)


def _addcmul(inputs: Sequence[Value], out: Value, scalars: dict[str, float]) -> float | None:
    if len(inputs) != 3:
        return None
    s, t1, t2 = inputs
    d1, d2 = _spread(t1, out), _spread(t2, out)
    value = abs(scalars.get("value", 1.0))
    return _spread(s, out) + value * (t2.largest * d1 + t1.largest * d2 + d1 * d2)


def _addcdiv(inputs: Sequence[Value], out: Value, scalars: dict[str, float]) -> float | None:
    if len(inputs) != 3:
        return None
    s, t1, t2 = inputs
    value = abs(scalars.get("value", 1.0))
    # ||value * t1 / t2|| <= ||out|| + ||self||: the quotient's size, from the output.
    quotient = out.norm + s.norm
    return (
        _spread(s, out)
        + value * _quotient(_spread(t1, out), t2.smallest)
        + quotient * _relative(t2)
    )


def _lerp(inputs: Sequence[Value], out: Value, scalars: dict[str, float]) -> float | None:
    weight = scalars.get("weight")
    if len(inputs) != 2 or weight is None:
        return None
    return abs(1.0 - weight) * _spread(inputs[0], out) + abs(weight) * _spread(inputs[1], out)


def _reduction(inputs: Sequence[Value], out: Value, _scalars: dict[str, float]) -> float | None:
    """A sum of ``k = n_in / n_out`` elements into each output: ``|sum of e| <= sqrt(k) ||e||``
    (Cauchy-Schwarz), over the outputs ``sqrt(k) ||d in||`` whatever cancels. A bias's
    gradient that is zero but for rounding (attention's key bias) is such a sum."""
    if len(inputs) != 1 or out.count <= 0:
        return None
    return math.sqrt(max(inputs[0].count / out.count, 1.0)) * inputs[0].error


def _average(inputs: Sequence[Value], out: Value, scalars: dict[str, float]) -> float | None:
    found = _reduction(inputs, out, scalars)
    if found is None:
        return None
    return found / max(inputs[0].count / out.count, 1.0)


def _inner(a: Value, b: Value, out: Value) -> float | None:
    """The length of a matrix product's sums, where the operands' element counts are those
    of ``(batch,) m x k`` and ``(batch,) k x n`` for an output of ``(batch,) m x n`` (in
    whatever shape their producers made them); ``None`` for any other (an operand read
    through an expanded or sliced view: its statistics are another tensor's)."""
    if len(out.shape) < 2 or min(out.shape) <= 0:
        return None
    rows, columns = out.shape[-2], out.shape[-1]
    batch = out.count / (rows * columns)
    inner_a, inner_b = a.count / (batch * rows), b.count / (batch * columns)
    if inner_a != inner_b or inner_a < 1 or inner_a != int(inner_a):
        return None
    return inner_a


def _matmul(inputs: Sequence[Value], out: Value, scalars: dict[str, float]) -> float | None:
    """``A @ B`` (``mm``, ``bmm``; ``addmm``: ``beta * self + alpha * A @ B``): over the
    tensor ``||dA|| ||B|| + ||A|| ||dB||`` (Frobenius norms bound the spectral ones), and
    the product's own rounding grows with the length of its sums."""
    if len(inputs) == 3:
        bias, a, b = inputs
        beta, alpha = abs(scalars.get("beta", 1.0)), abs(scalars.get("alpha", 1.0))
    elif len(inputs) == 2:
        bias, (a, b), beta, alpha = None, inputs, 0.0, 1.0
    else:
        return None
    inner = _inner(a, b, out)
    if inner is None:
        return None
    product = alpha * (a.error * b.norm + a.norm * b.error + a.error * b.error)
    own = OWN_ROUNDING * _UNIT.get(out.dtype, 2.0**-24) * math.sqrt(inner) * out.norm
    return product + own + (beta * _spread(bias, out) if bias is not None else 0.0)


def _lipschitz(constant: float) -> _Bound:
    def bound(inputs: Sequence[Value], out: Value, _scalars: dict[str, float]) -> float | None:
        return constant * inputs[0].error if len(inputs) == 1 else None

    return bound


def _exp(inputs: Sequence[Value], out: Value, _scalars: dict[str, float]) -> float | None:
    if len(inputs) != 1:
        return None
    error = inputs[0].error
    return out.largest * error * math.exp(min(error, 700.0))


KINDS: Final[dict[str, _Bound]] = {
    "add": _sum,
    "sub": _sum,
    "rsub": _sum,
    "mul": _product,
    "div": _quotient_op,
    "addcmul": _addcmul,
    "addcdiv": _addcdiv,
    "lerp": _lerp,
    "mm": _matmul,
    "bmm": _matmul,
    "addmm": _matmul,
    "_softmax": _lipschitz(1.0),
    "sum": _reduction,
    "mean": _average,
    "neg": _lipschitz(1.0),
    "abs": _lipschitz(1.0),
    "relu": _lipschitz(1.0),
    "tanh": _lipschitz(1.0),
    "sigmoid": _lipschitz(0.25),
    "gelu": _lipschitz(1.13),
    "silu": _lipschitz(1.1),
    "exp": _exp,
}
"""The kinds of op with a bound: the op's name without ``aten::``, its overload or the
trailing ``_`` of the in-place form."""


def kind_of(name: str) -> str:
    """``aten::addcdiv_`` and ``aten::div.Tensor`` -> ``addcdiv``, ``div``."""
    base = name.rpartition("::")[2].partition(".")[0]
    return base[:-1] if base.endswith("_") and not base.endswith("__") else base


def explained_error(
    name: str,
    scalars: dict[str, float],
    inputs: Sequence[Value | None],
    out: Value,
) -> float | None:
    """The largest absolute error ``||a - b||`` at an op's output its inputs' errors (and its
    own rounding) explain, or ``None`` where the op's kind has no bound or an input's
    statistics are not known."""
    bound = KINDS.get(kind_of(name))
    if bound is None or any(value is None for value in inputs):
        return None
    known = [value for value in inputs if value is not None]
    found = bound(known, out, scalars)
    if found is None or math.isnan(found):
        return None
    return found + OWN_ROUNDING * _UNIT.get(out.dtype, 2.0**-24) * out.norm
