"""Values as bytes: the one canonical byte form, behind fingerprints, ``Snapshot`` equality
and keyed collation.

:func:`canonical_bytes` writes any nested value (the containers of
:mod:`detctx._basics.nested`, tensors, arrays, numbers, strings, sets) so
that equal bytes mean equal values: every part is tagged with its kind and
prefixed with its length, a tensor or array carries its dtype and shape, a
mapping's items and a set's elements are sorted by their own bytes (so
neither insertion order nor ``PYTHONHASHSEED`` shows). A value it cannot
write the same way in every process (a meta tensor, an object holding a set)
is refused with ``TypeError`` in ``strict`` mode, which keyed collation uses;
captured RNG states fall back to ``repr`` for such leaves.

Two captures of the same RNG state must compare equal however they were read.
An accelerator is read in two ways: a device type the program has not
initialised is captured as the seed pending for it (never waking it), an
initialised one as one state tensor per device. A device initialised with
the pending seed ``s`` and not drawn from since holds exactly "seed ``s``,
nothing drawn", so both forms of that state give the same bytes here:
``b"fresh s"``. :func:`fingerprint` digests states; :class:`detctx.Snapshot`
compares them.

Which device states read as "fresh": a 16-byte state is a Philox state (CUDA,
and torch_npu and XPU alike: seed, then offset, each a little-endian uint64;
``python -c "import torch; torch.cuda.manual_seed(5);
print(torch.cuda.get_rng_state())"`` prints 5 then eight zero bytes) and is
fresh when its offset is 0. A state laid out as the CPU generator's (a
Mersenne Twister, seed first) is fresh when it equals a CPU generator just
seeded with that seed. Any other layout is compared byte for byte.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import pickletools
import struct
from array import array
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
import torch

from detctx._basics import nested
from detctx._sources import AcceleratorSource, RNGSource, Uninitialised

__all__ = [
    "accelerator_value",
    "canonical_bytes",
    "device_state_seed",
    "fingerprint",
    "state_value",
]

_PHILOX_BYTES = 16
_SET_OPCODES = frozenset({"EMPTY_SET", "ADDITEMS", "FROZENSET"})


class _Sink(Protocol):
    def update(self, data: bytes, /) -> None: ...


class _Bytes:
    """A sink that keeps what it is fed."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def update(self, data: bytes, /) -> None:
        self.parts.append(data)


def canonical_bytes(value: Any, *, strict: bool = False) -> bytes:
    """The canonical bytes of ``value``: equal bytes, equal values (see the module's text).

    ``strict``: refuse, with ``TypeError``, what would not give the same bytes
    in another process (instead of writing its ``repr``).
    """
    sink = _Bytes()
    _feed(sink, value, strict=strict)
    return b"".join(sink.parts)


def state_value(source: RNGSource, state: Any) -> bytes:
    """The canonical bytes of ``state``, as ``source`` captured it: equal bytes, equal states."""
    sink = _Bytes()
    _feed_state(sink, source, state)
    return b"".join(sink.parts)


def fingerprint(parts: Iterable[tuple[str, RNGSource, Any]]) -> str:
    """A 16-hex-digit digest of ``(name, source, state)`` parts, by value."""
    digest = hashlib.blake2b(digest_size=8)
    for name, source, state in parts:
        _text(digest, b"n", name.encode("utf-8", "surrogatepass"))
        _feed_state(digest, source, state)
    return digest.hexdigest()


def accelerator_value(state: Any) -> bytes:
    """The canonical bytes of an accelerator capture (pending seed or per-device states)."""
    if isinstance(state, Uninitialised):
        return b"fresh %d" % state.seed_before
    raw = [_device_bytes(device_state) for device_state in state]
    seeds = {_fresh_seed(device_bytes) for device_bytes in raw}
    if len(seeds) == 1 and (seed := seeds.pop()) is not None:
        return b"fresh %d" % seed
    return b"".join(b"D%d:" % len(device_bytes) + device_bytes for device_bytes in raw)


def _feed_state(sink: _Sink, source: RNGSource, state: Any) -> None:
    if isinstance(source, AcceleratorSource):
        _text(sink, b"a", accelerator_value(state))
    else:
        _feed(sink, state, strict=False)


def _device_bytes(state: Any) -> bytes:
    if isinstance(state, torch.Tensor):
        return bytes(state.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return repr(state).encode()


def device_state_seed(state: torch.Tensor) -> int | None:
    """The seed a device RNG state was seeded with, where its layout keeps it (a Philox
    state's and a CPU generator's first eight bytes keep it whatever was drawn since)."""
    if state.dtype != torch.uint8 or state.dim() != 1:
        return None
    if state.numel() not in (_PHILOX_BYTES, len(_cpu_fresh_state(0))):
        return None
    (seed,) = struct.unpack_from("<Q", bytes(state[:8].tolist()))
    return int(seed)


def _fresh_seed(state: bytes) -> int | None:
    """The seed of a device state that was seeded and not drawn from since, else None."""
    if len(state) == _PHILOX_BYTES:
        seed, offset = struct.unpack("<QQ", state)
        return int(seed) if offset == 0 else None
    if len(state) == len(_cpu_fresh_state(0)):
        (seed,) = struct.unpack_from("<Q", state)
        return int(seed) if state == _cpu_fresh_state(seed) else None
    return None


@functools.lru_cache(maxsize=16)
def _cpu_fresh_state(seed: int) -> bytes:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return bytes(generator.get_state().numpy().tobytes())


def _text(sink: _Sink, tag: bytes, data: bytes) -> None:
    """``data`` tagged and length-prefixed, so no two sequences of parts run together."""
    sink.update(tag + b"%d:" % len(data))
    sink.update(data)


def _pack_ints(values: tuple[Any, ...] | list[Any]) -> bytes | None:
    """64-bit ints packed in one call (Python's random state is 625 of them, a batch's
    labels hold -100s), tagged unsigned or signed; ``None`` when they do not fit."""
    # Exactly int: array("Q") takes True as 1, which would make [True] equal [1].
    if not values or set(map(type, values)) != {int}:
        return None
    for code, tag in (("Q", b"u"), ("q", b"s")):
        try:
            return tag + array(code, values).tobytes()
        except OverflowError:
            continue
    return None


def _feed(sink: _Sink, value: Any, *, strict: bool) -> None:
    """Feed ``value`` canonically: the same value always gives the same bytes."""
    if isinstance(value, torch.Tensor):
        _feed_tensor(sink, value, strict=strict)
    elif isinstance(value, np.ndarray):
        _feed_array(sink, value, strict=strict)
    elif value is None or type(value) is bool:
        _text(sink, b"s", repr(value).encode())
    elif isinstance(value, np.generic):
        _text(sink, b"g", str(value.dtype).encode() + b"=" + value.tobytes())
    elif type(value) is int:
        _text(sink, b"i", b"%d" % value)
    elif type(value) is float:
        _text(sink, b"f", struct.pack("<d", value))
    elif type(value) is str:
        _text(sink, b"u", value.encode("utf-8", "surrogatepass"))
    elif type(value) in (bytes, bytearray):
        _text(sink, b"y", bytes(value))
    elif isinstance(value, (set, frozenset)):
        # Sorted by their own bytes: a set's iteration order follows PYTHONHASHSEED.
        items = sorted(canonical_bytes(item, strict=strict) for item in value)
        sink.update(b"S%d:" % len(items))
        for item in items:
            _text(sink, b"e", item)
    elif (found := nested.branches(value)) is not None:
        _feed_container(sink, value, found, strict=strict)
    else:
        _feed_object(sink, value, strict=strict)


def _feed_container(
    sink: _Sink, value: Any, found: tuple[nested.Kind, list[tuple[Any, Any]]], *, strict: bool
) -> None:
    kind, items = found
    name = type(value).__qualname__.encode()
    sink.update(b"C%s:%d:" % (kind.value.encode(), len(items)))
    if kind in (nested.Kind.NAMEDTUPLE, nested.Kind.DATACLASS):
        _text(sink, b"t", name)
    if kind in (nested.Kind.LIST, nested.Kind.TUPLE):
        packed = _pack_ints([item for _, item in items])
        if packed is not None:
            _text(sink, b"I", packed)
            return
        for _, item in items:
            _feed(sink, item, strict=strict)
        return
    if kind is nested.Kind.MAPPING:
        keyed = sorted(
            ((canonical_bytes(key, strict=strict), item) for key, item in items),
            key=lambda pair: pair[0],
        )
        for key_bytes, item in keyed:
            _text(sink, b"k", key_bytes)
            _feed(sink, item, strict=strict)
        return
    for _, item in items:
        _feed(sink, item, strict=strict)


def _feed_tensor(sink: _Sink, value: torch.Tensor, *, strict: bool) -> None:
    tensor = value.detach()
    head = b"T%s:%s:%s:" % (
        str(tensor.dtype).encode(),
        str(tensor.layout).encode(),
        str(tuple(tensor.shape) if not tensor.is_nested else tensor.size(0)).encode(),
    )
    if tensor.is_nested:
        sink.update(head)
        for component in tensor.unbind():
            _feed_tensor(sink, component, strict=strict)
        return
    if tensor.is_quantized or tensor.device.type == "meta":
        what = "a quantized" if tensor.is_quantized else "a meta"
        raise TypeError(
            f"cannot write {what} tensor ({tensor.dtype}, shape {tuple(tensor.shape)}) as "
            "bytes: "
            + (
                "its values need its scale and zero point; dequantize it first"
                if tensor.is_quantized
                else "it holds no data"
            )
        )
    try:
        if tensor.layout != torch.strided:
            coalesced = tensor.to_sparse_coo().coalesce()  # type: ignore[no-untyped-call]
            sink.update(head)
            _feed_tensor(sink, coalesced.indices(), strict=strict)
            _feed_tensor(sink, coalesced.values(), strict=strict)
            return
        # A conjugate or negative view holds its data un-negated: materialise it first.
        plain = tensor.resolve_conj().resolve_neg().cpu().contiguous()
        data = plain.reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise TypeError(
            f"cannot read the values of a {type(value).__name__} ({tensor.dtype}, layout "
            f"{tensor.layout}, on {tensor.device}) as bytes: {exc}"
        ) from exc
    sink.update(head)
    _text(sink, b"d", data)


def _feed_array(sink: _Sink, value: np.ndarray, *, strict: bool) -> None:
    head = b"A%s:%s:" % (str(value.dtype).encode(), str(value.shape).encode())
    sink.update(head)
    if value.dtype.hasobject:
        if value.dtype.kind != "O":
            raise TypeError(
                f"cannot write a structured array holding objects ({value.dtype}) as bytes: "
                "its bytes are memory addresses"
            )
        # An object array's bytes are the addresses of its elements: write the elements.
        for item in value.reshape(-1).tolist():
            _feed(sink, item, strict=strict)
        return
    _text(sink, b"d", np.ascontiguousarray(value).tobytes())


def _feed_object(sink: _Sink, value: Any, *, strict: bool) -> None:
    name = f"{type(value).__module__}.{type(value).__qualname__}".encode()
    if not strict:
        _text(sink, b"r", name + b"=" + repr(value).encode("utf-8", "surrogatepass"))
        return
    # Anything else by its pickled bytes: a repr may hold a memory address.
    try:
        data = pickle.dumps(value, protocol=4)
    except Exception as exc:
        raise TypeError(
            f"cannot write a {name.decode()} as bytes: it cannot be pickled ({exc})"
        ) from exc
    if any(opcode.name in _SET_OPCODES for opcode, _, _ in pickletools.genops(data)):
        raise TypeError(
            f"cannot write a {name.decode()} as bytes the same way in every process: it "
            "holds a set, whose order follows PYTHONHASHSEED; give it a list or a sorted "
            "tuple instead"
        )
    _text(sink, b"p", name + b"=" + data)
