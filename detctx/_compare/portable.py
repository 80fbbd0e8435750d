"""Random ops drawn portably: the same bits on every device and torch release, from a seed.

Each torch release and device draws its own numbers from one seed (the CPU's
Mersenne Twister, CUDA's and NPU's Philox with their own offsets, kernels
that consume them in their own order), so two environments' recordings of a
training with dropout part at its first mask. Under
``detctx.recording(..., portable_random=SEED)`` every random op the
recording's dispatch mode sees draws instead from a counter-based generator:
word ``i`` of the ``n``-th random op of the recording (in this process) is
SplitMix64's finaliser over ``(SEED, n, i)`` (:func:`detctx._basics.indexed_seed`
and ``indexed_words``), computed with NumPy's uint64 arithmetic on the CPU,
exact on every machine. Each value is made from its element's words in
float64 or int64 on the CPU, converted to the op's dtype there and copied to
its device: masks, integers and uniforms are the same bits everywhere;
normals (Box-Muller) and exponentials go through NumPy's ``log`` and ``cos``,
which may differ in the last bit between machines, within any tolerance.

Covered: ``bernoulli`` (a mask ``u < p``, ``p`` a number or read elementwise),
``uniform``, ``rand``, ``normal``, ``randn``, ``random``, ``randint``,
``randperm`` (the order of the words), ``exponential`` and ``native_dropout``
(keep where ``u < 1 - p``), with their in-place, ``_like`` and ``out=``
forms. CPU dropout runs ``bernoulli_`` below autograd, CUDA's and NPU's
``native_dropout``: both draw the same mask. A ``generator=`` argument is
ignored: the portable key replaces it. torch's generators are not advanced.
Any other op torch tags ``nondeterministic_seeded`` is refused with
:class:`~detctx.TraceError` before it runs, unless its arguments say it draws
nothing (``train=False``, a dropout probability of 0: SDPA's kernels
without dropout), and so is an extension's op whose name says dropout (torch
does not tag torch_npu's own). Meta tensors draw nothing and pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import torch

from detctx._basics import TraceError, indexed_seed, indexed_words

__all__ = ["PortableRandom"]

_ADVICE: Final = (
    "record without portable_random (detctx.recording(..., portable_random=None), detctx "
    "record without --portable-random) to compare such runs"
)
_FACTORY: Final = ("dtype", "layout", "device", "pin_memory", "memory_format")
_INTEGERS: Final = frozenset({"aten::randint", "aten::randperm"})
"""Factories whose dtype is int64 unless told."""
_PLAIN: Final = (torch.Tensor, torch.nn.Parameter)


class PortableRandom:
    """The portable draws of one recording in one process: the ``n``-th random op it draws
    for is keyed by ``(seed, n)``; each op draws its words once, when its arguments have
    been checked."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.ops = 0

    @staticmethod
    def handles(func: Any) -> bool:
        """Whether ``func`` is an op it draws for or refuses (a random one)."""
        return _handler(func) is not None

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the op ``func``: drawn portably when it is random, refused when it is random
        and not covered, as it is otherwise."""
        handler = _handler(func)
        if handler is None:
            return func(*args, **kwargs)
        call = _Call(func, args, kwargs)
        if call.draws_nothing():
            return func(*args, **kwargs)
        return handler(self, call)

    def words(self, count: int) -> np.ndarray[Any, Any]:
        """``count`` uint64 words of the next random op."""
        key = indexed_seed(self.seed, self.ops)
        self.ops += 1
        return indexed_words(key, count)


class _Call:
    """One random op's call: its arguments by name (defaults filled in), its output's
    shape and dtype, and how its values are handed back."""

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        schema = func._schema
        self.name: str = schema.name
        overload = func._overloadname
        self.label = self.name if overload == "default" else f"{self.name}.{overload}"
        self.bound: dict[str, Any] = {}
        for position, argument in enumerate(schema.arguments):
            if position < len(args) and not argument.kwarg_only:
                self.bound[argument.name] = args[position]
            elif argument.name in kwargs:
                self.bound[argument.name] = kwargs[argument.name]
            elif argument.has_default_value():
                self.bound[argument.name] = argument.default_value
        self.tensors = [t for t in _flat([*args, *kwargs.values()]) if isinstance(t, torch.Tensor)]

    def draws_nothing(self) -> bool:
        """Its arguments say it draws nothing: not training, a dropout probability of 0, or
        meta tensors (no data)."""
        bound = self.bound
        if bound.get("train") is False or bound.get("training") is False:
            return True
        if any(bound.get(name) == 0 for name in ("dropout_p", "dropout")):
            return True
        if "dropout" in self.name and bound.get("p") == 0:
            return True
        return any(tensor.device.type == "meta" for tensor in self.tensors)

    def refuse(self, why: str) -> TraceError:
        return TraceError(f"{self.label} {why}: {_ADVICE}")

    @property
    def template(self) -> torch.Tensor | None:
        """The tensor the output is shaped like (``self``, ``input``), if any."""
        for name in ("self", "input"):
            found = self.bound.get(name)
            if isinstance(found, torch.Tensor):
                return found
        return None

    def factory(self) -> dict[str, Any]:
        """The dtype, layout, device and memory format a new output is made with."""
        given = {name: self.kwargs[name] for name in _FACTORY if self.kwargs.get(name) is not None}
        if self.name in _INTEGERS:
            given.setdefault("dtype", torch.int64)
        return given

    def shape(self) -> tuple[int, ...]:
        bound = self.bound
        if "size" in bound:
            return tuple(int(size) for size in bound["size"])
        if "n" in bound:
            return (int(bound["n"]),)
        template = self.template
        if template is not None:
            return tuple(template.shape)
        return tuple(np.broadcast_shapes(*(tuple(t.shape) for t in self.moments())))

    def moments(self) -> list[torch.Tensor]:
        """``normal``'s ``mean`` and ``std`` where they are tensors."""
        found = (self.bound.get("mean"), self.bound.get("std"))
        return [value for value in found if isinstance(value, torch.Tensor)]

    def dtype(self) -> torch.dtype:
        out, template = self.bound.get("out"), self.template
        if isinstance(out, torch.Tensor):
            return out.dtype
        given = self.factory().get("dtype")
        if given is not None:
            return given  # type: ignore[no-any-return]
        if template is not None:
            return template.dtype
        moments = self.moments()
        return moments[0].dtype if moments else torch.get_default_dtype()

    def check(self, dtype: torch.dtype, *, floating: bool) -> None:
        """Refuse what the portable draws do not make: tensor subclasses (a DTensor's shards
        draw through its own RNG tracker), layouts other than strided, complex values."""
        for tensor in self.tensors:
            if type(tensor) not in _PLAIN:
                raise self.refuse(f"on a {type(tensor).__name__} is not drawn portably")
            if tensor.layout != torch.strided:
                raise self.refuse(f"on a {tensor.layout} tensor is not drawn portably")
        if self.factory().get("layout", torch.strided) != torch.strided:
            raise self.refuse("with a layout other than strided is not drawn portably")
        if dtype.is_complex:
            raise self.refuse(f"of {dtype} is not drawn portably")
        if floating and not dtype.is_floating_point:
            raise RuntimeError(f"{self.label}: not implemented for {dtype} (floats only)")

    def deliver(self, values: np.ndarray[Any, Any], dtype: torch.dtype) -> Any:
        """Hand ``values`` (the output's elements in order, float64, int64 or bool) back as
        the op does: written into ``self`` (in place) or ``out``, or a new tensor."""
        shape = self.shape()
        # Converted on the CPU, so every device receives the same bits.
        made = torch.from_numpy(np.ascontiguousarray(values)).reshape(shape).to(dtype)
        out, template = self.bound.get("out"), self.template
        if isinstance(out, torch.Tensor):
            if tuple(out.shape) != shape:
                out.resize_(shape)
            return out.copy_(made)
        if self.name.endswith("_") and template is not None:
            return template.copy_(made)
        factory = self.factory()
        if template is not None:  # a _like op's, or a functional form's
            result = torch.empty_like(template, **factory)
        else:
            factory.pop("memory_format", None)
            moments = self.moments()
            if moments and "device" not in factory:
                factory["device"] = moments[0].device
            result = torch.empty(shape, **{**factory, "dtype": dtype})
        return result.copy_(made)


def _flat(values: list[Any]) -> list[Any]:
    found: list[Any] = []
    for value in values:
        found.extend(_flat(list(value)) if isinstance(value, (list, tuple)) else [value])
    return found


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _units(words: np.ndarray[Any, Any], bits: int = 53) -> np.ndarray[Any, Any]:
    """Uniforms in ``[0, 1)`` from the top ``bits`` bits: each one exact in a float of
    ``bits`` significant bits, so none rounds up to 1 in the op's dtype."""
    return (words >> np.uint64(64 - bits)).astype(np.float64) * 2.0**-bits


def _open_units(words: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Uniforms in ``(0, 1)``: the top 53 bits and half a step, never 0 (for ``log``)."""
    return ((words >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _significand(dtype: torch.dtype) -> int:
    # eps is 2**-(significant bits - 1): float32's 2**-23, bfloat16's 2**-7.
    return min(round(1 - math.log2(torch.finfo(dtype).eps)), 53)


def _as_array(value: Any, shape: tuple[int, ...]) -> np.ndarray[Any, Any] | float:
    """A number, or a tensor's values in float64 broadcast to ``shape`` and flattened."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    values = value.detach().to("cpu", torch.float64).numpy()
    return np.broadcast_to(values, shape).reshape(-1)


def _bernoulli(draws: PortableRandom, call: _Call) -> Any:
    dtype = call.dtype()
    call.check(dtype, floating=False)
    shape = call.shape()
    p = _as_array(call.bound.get("p", call.bound["self"]), shape)
    if not np.all((np.asarray(p) >= 0) & (np.asarray(p) <= 1)):
        raise RuntimeError(f"{call.label} expects p to be in [0, 1]")
    return call.deliver(_units(draws.words(_numel(shape))) < p, dtype)


def _uniform(draws: PortableRandom, call: _Call) -> Any:
    dtype = call.dtype()
    call.check(dtype, floating=True)
    low, high = float(call.bound.get("from", 0.0)), float(call.bound.get("to", 1.0))
    if not low <= high:
        raise RuntimeError(f"{call.label} expects a [from, to) range, got from={low} > to={high}")
    units = _units(draws.words(_numel(call.shape())), _significand(dtype))
    return call.deliver(units if (low, high) == (0.0, 1.0) else low + (high - low) * units, dtype)


def _normal(draws: PortableRandom, call: _Call) -> Any:
    dtype = call.dtype()
    call.check(dtype, floating=True)
    shape = call.shape()
    mean = _as_array(call.bound.get("mean", 0.0), shape)
    std = _as_array(call.bound.get("std", 1.0), shape)
    if not np.all(np.asarray(std) >= 0):
        raise RuntimeError(f"{call.label} expects std >= 0.0")
    words = draws.words(2 * _numel(shape))
    # Box-Muller, one normal from each pair of words.
    radius = np.sqrt(-2.0 * np.log(_open_units(words[0::2])))
    normals = radius * np.cos(2.0 * np.pi * _units(words[1::2]))
    return call.deliver(mean + std * normals, dtype)


def _exponential(draws: PortableRandom, call: _Call) -> Any:
    dtype = call.dtype()
    call.check(dtype, floating=True)
    rate = float(call.bound.get("lambd", 1.0))
    if not rate > 0:
        raise RuntimeError(f"{call.label} expects lambda > 0.0, got {rate}")
    units = _open_units(draws.words(_numel(call.shape())))
    return call.deliver(-np.log(units) / rate, dtype)


def _top(dtype: torch.dtype) -> int:
    """The largest value ``random_`` draws unless told: every one exact in ``dtype``."""
    if dtype == torch.bool:
        return 1
    if dtype.is_floating_point:
        return 1 << _significand(dtype)
    return int(torch.iinfo(dtype).max)


def _integers(draws: PortableRandom, call: _Call) -> Any:
    """``random``, ``randint``: ``low + word mod (high - low)``, exact integer arithmetic."""
    dtype = call.dtype()
    call.check(dtype, floating=False)
    bound = call.bound
    low = int(bound.get("low", bound.get("from", 0)))
    high = bound.get("high", bound.get("to"))
    high = _top(dtype) + 1 if high is None else int(high)  # a tensor's high too
    if not low < high or high - low > 2**64:
        raise RuntimeError(f"{call.label} expects from < to (within 2**64), got {low}, {high}")
    words = draws.words(_numel(call.shape()))
    if high - low < 2**64:
        words %= np.uint64(high - low)
    words += np.uint64(low % 2**64)  # wraps modulo 2**64: the int64's two's complement
    return call.deliver(words.view(np.int64), dtype)


def _randperm(draws: PortableRandom, call: _Call) -> Any:
    dtype = call.dtype()
    call.check(dtype, floating=False)
    # The words of one op are distinct (the finaliser is a bijection), so the order is one.
    order = np.argsort(draws.words(int(call.bound["n"])), kind="stable")
    return call.deliver(order.astype(np.int64), dtype)


def _native_dropout(draws: PortableRandom, call: _Call) -> Any:
    """``(input * mask * scale, mask)``, ``mask`` kept where ``u < 1 - p``: as CPU dropout's
    ``bernoulli_(1 - p)`` draws it, so a CUDA or NPU run and a CPU one draw the same."""
    source: torch.Tensor = call.bound["input"]
    call.check(source.dtype, floating=False)
    p = float(call.bound["p"])
    if not 0 <= p <= 1:
        raise RuntimeError(f"{call.label}: dropout probability has to be between 0 and 1")
    keep = _units(draws.words(source.numel())) < 1 - p
    mask = torch.empty_like(source, dtype=torch.bool)
    mask.copy_(torch.from_numpy(keep).reshape(source.shape))
    # As torch's CPU kernel computes it (aten/src/ATen/native/Dropout.cpp).
    output = source.mul(mask).mul_(0.0 if p == 1 else 1.0 / (1.0 - p))
    out0, out1 = call.bound.get("out0"), call.bound.get("out1")
    if isinstance(out0, torch.Tensor) and isinstance(out1, torch.Tensor):
        for out, made in ((out0, output), (out1, mask)):
            if out.shape != made.shape:
                out.resize_(made.shape)
            out.copy_(made)
        return out0, out1
    return output, mask


def _refuse(draws: PortableRandom, call: _Call) -> Any:
    hint = ""
    if "attention" in call.name:
        hint = (
            " with dropout (SDPA's math kernel, torch.nn.attention.sdpa_kernel("
            "SDPBackend.MATH), draws its dropout through bernoulli_, which is drawn portably)"
        )
    raise call.refuse(f"draws random numbers{hint} that portable_random does not draw")


_HANDLERS: Final[dict[str, Callable[[PortableRandom, _Call], Any]]] = {
    "aten::bernoulli": _bernoulli,
    "aten::bernoulli_": _bernoulli,
    "aten::uniform": _uniform,
    "aten::uniform_": _uniform,
    "aten::rand": _uniform,
    "aten::rand_like": _uniform,
    "aten::normal": _normal,
    "aten::normal_": _normal,
    "aten::normal_functional": _normal,
    "aten::randn": _normal,
    "aten::randn_like": _normal,
    "aten::exponential": _exponential,
    "aten::exponential_": _exponential,
    "aten::random": _integers,
    "aten::random_": _integers,
    "aten::randint": _integers,
    "aten::randint_like": _integers,
    "aten::randperm": _randperm,
    "aten::native_dropout": _native_dropout,
}
_SEEDED: Final = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)
_known: dict[Any, Callable[[PortableRandom, _Call], Any] | None] = {}


def _handler(func: Any) -> Callable[[PortableRandom, _Call], Any] | None:
    """How ``func`` is run under portable draws: ``None`` for an op that draws nothing."""
    try:
        return _known[func]
    except KeyError:
        pass
    name = func._schema.name
    handler = _HANDLERS.get(name)
    if handler is None and _SEEDED is not None and _SEEDED in getattr(func, "tags", ()):
        handler = _refuse
    elif handler is None and "dropout" in name and not name.startswith("aten::"):
        handler = _refuse  # an extension's dropout (torch_npu's own), which torch does not tag
    _known[func] = handler
    return handler
