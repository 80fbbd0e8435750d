"""RNG states as values: one canonical byte form per captured state.

Two captures of the same RNG state must compare equal however they were read.
An accelerator is read in two ways: a device type the program has not
initialised is captured as the seed pending for it (never waking it), an
initialised one as one state tensor per device. A device initialised with
the pending seed ``s`` and not drawn from since holds exactly "seed ``s``,
nothing drawn", so both forms of that state give the same bytes here:
``b"fresh s"``. Every other state gives its own bytes (dtype and contents of
tensors and arrays, ints packed, the rest by ``repr``), so equal bytes mean
equal states. :func:`fingerprint` digests them; :class:`detctx.Snapshot`
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
import struct
from array import array
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
import torch

from detctx._sources import AcceleratorSource, RNGSource, Uninitialised

__all__ = ["accelerator_value", "fingerprint", "state_value"]

_PHILOX_BYTES = 16


class _Sink(Protocol):
    def update(self, data: bytes, /) -> None: ...


class _Bytes:
    """A sink that keeps what it is fed."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def update(self, data: bytes, /) -> None:
        self.parts.append(data)


def state_value(source: RNGSource, state: Any) -> bytes:
    """The canonical bytes of ``state``, as ``source`` captured it: equal bytes, equal states."""
    sink = _Bytes()
    _feed_state(sink, source, state)
    return b"".join(sink.parts)


def fingerprint(parts: Iterable[tuple[str, RNGSource, Any]]) -> str:
    """A 16-hex-digit digest of ``(name, source, state)`` parts, by value."""
    digest = hashlib.blake2b(digest_size=8)
    for name, source, state in parts:
        digest.update(name.encode())
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
        sink.update(accelerator_value(state))
    else:
        _feed(sink, state)


def _device_bytes(state: Any) -> bytes:
    if isinstance(state, torch.Tensor):
        return bytes(state.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return repr(state).encode()


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


def _pack_ints(values: tuple[Any, ...] | list[Any]) -> bytes | None:
    """Non-negative 64-bit ints packed in one call (Python's random state is 625 of them)."""
    if not values or type(values[0]) is not int:
        return None
    try:
        return b"I%d" % len(values) + array("Q", values).tobytes()
    except (TypeError, OverflowError):
        return None


def _feed(sink: _Sink, value: Any) -> None:
    """Feed ``value`` canonically: the same value always gives the same bytes."""
    if isinstance(value, torch.Tensor):
        sink.update(b"T" + str(value.dtype).encode())
        sink.update(value.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(value, np.ndarray):
        sink.update(b"A" + str(value.dtype).encode())
        sink.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (tuple, list)) and (packed := _pack_ints(value)) is not None:
        sink.update(packed)
    elif isinstance(value, (tuple, list)):
        sink.update(b"(%d" % len(value))
        for item in value:
            _feed(sink, item)
    elif isinstance(value, dict):
        sink.update(b"{%d" % len(value))
        for key in sorted(value, key=repr):
            sink.update(repr(key).encode())
            _feed(sink, value[key])
    else:
        sink.update(repr(value).encode())
