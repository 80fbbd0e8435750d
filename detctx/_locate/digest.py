"""Bit-exact digests of tensors, computed where the tensor lives.

A digest is a 64-bit integer: the tensor's bits read as unsigned words (1,
2, 4 or 8 bytes, the element size; 16-byte elements as two 8-byte words),
each word ``w_i`` at flat position ``i`` multiplied by a multiplier ``m_i``,
summed modulo ``2**64``. ``m_i`` is ``splitmix64(i)`` with its lowest bit
set: odd, and unrelated from one position to the next.

Why a one-element change always changes the digest: the word changes by
some ``delta`` with ``0 < |delta| < 2**64``, so the sum changes by
``delta * m_i``, which is never ``0`` modulo ``2**64`` because an odd number
is invertible modulo a power of two. Changes in several elements cancel
only if ``sum(delta_i * m_i) == 0 (mod 2**64)``; with multipliers that follow
no pattern in ``i`` (a plain ``i * c`` would let ``+1, -2, +1`` in three
neighbours cancel) that is a 2**-64 accident, not a structure. Positions
matter (a permutation changes the digest), and ``-0.0`` / ``0.0`` or two NaN
payloads differ, as their bits do.

On an accelerator only the final sum (one scalar) is copied to the host; on
the CPU the same arithmetic runs in NumPy on the tensor's own memory (faster
for the small tensors of most ops). Both give the same digest for the same
bits, which ``tests/test_locate_digest.py`` checks.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch

__all__ = ["digest", "digest_words"]

_MASK: Final = (1 << 64) - 1
_GAMMA: Final = 0x9E3779B97F4A7C15
_MIX1: Final = 0xBF58476D1CE4E5B9
_MIX2: Final = 0x94D049BB133111EB
_CACHED_POSITIONS: Final = 1 << 20
"""Multipliers are cached for tensors up to this many words; larger ones build theirs."""

_WORDS: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
_NUMPY_WORDS: Final = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}

_numpy_multipliers: np.ndarray = np.zeros(0, dtype=np.uint64)
_torch_multipliers: dict[torch.device, torch.Tensor] = {}


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _size(count: int) -> int:
    return count if count > _CACHED_POSITIONS else min(_CACHED_POSITIONS, max(count, 1024) * 2)


def _numpy_positions(count: int) -> np.ndarray:
    global _numpy_multipliers
    if count <= len(_numpy_multipliers):
        return _numpy_multipliers[:count]
    size = _size(count)
    z = (np.arange(1, size + 1, dtype=np.uint64) * np.uint64(_GAMMA)).astype(np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    z |= np.uint64(1)
    if size <= _CACHED_POSITIONS:
        _numpy_multipliers = z
    return z[:count]


def _logical_shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    # int64 has only an arithmetic shift; masking the sign copies makes it logical.
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _torch_positions(count: int, device: torch.device) -> torch.Tensor:
    cached = _torch_multipliers.get(device)
    if cached is not None and count <= cached.numel():
        return cached[:count]
    size = _size(count)
    z = torch.arange(1, size + 1, dtype=torch.int64, device=device) * _signed(_GAMMA)
    z = (z ^ _logical_shift(z, 30)) * _signed(_MIX1)
    z = (z ^ _logical_shift(z, 27)) * _signed(_MIX2)
    z ^= _logical_shift(z, 31)
    z |= 1
    if size <= _CACHED_POSITIONS:
        _torch_multipliers[device] = z
    return z[:count]


def digest_words(words: np.ndarray) -> int:
    """The digest of unsigned integer words (any width up to 64 bits), in NumPy."""
    flat = words.reshape(-1)
    # Unsigned integer dot products wrap modulo 2**64 without a warning.
    return int(np.dot(flat.astype(np.uint64, copy=False), _numpy_positions(len(flat))))


def _torch_digest(words: torch.Tensor, width: int) -> int:
    wide = words.reshape(-1).to(torch.int64)
    if width < 8:
        # Zero-extend: torch widens signed words with their sign, NumPy's unsigned ones do not.
        wide &= (1 << (8 * width)) - 1
    # torch has no unsigned 64-bit arithmetic before 2.3; int64 products and sums wrap
    # modulo 2**64, which is all the digest needs.
    mixed = wide * _torch_positions(wide.numel(), wide.device)
    return int(mixed.sum().item()) & _MASK


def digest(tensor: torch.Tensor, *, on_host: bool | None = None) -> int | None:
    """The 64-bit digest of ``tensor``'s elements, or ``None`` when its bits cannot be read.

    Only the values' bits count (shape and dtype are recorded beside the
    digest); a non-contiguous view is read in its logical order. Sparse,
    quantized and meta tensors and tensor subclasses have no digest.
    ``on_host`` forces the NumPy path (``True``) or the torch path
    (``False``); by default CPU tensors use NumPy.
    """
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return None
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        return None
    width = tensor.element_size()
    word = _WORDS.get(width)
    if word is None:
        return None
    if on_host is None and tensor.device.type == "cpu" and tensor.dtype != torch.bfloat16:
        # One call for the common case: numpy(force=True) detaches and resolves conj/neg.
        array = np.ascontiguousarray(tensor.numpy(force=True))
        return digest_words(array.view(_NUMPY_WORDS[width]))
    flat = tensor.detach()
    if flat.is_conj():
        flat = flat.resolve_conj()
    if flat.is_neg():
        flat = flat.resolve_neg()
    words = flat.reshape(-1).view(word)
    if on_host is None:
        on_host = words.device.type == "cpu"
    if on_host:
        return digest_words(words.cpu().numpy().view(_NUMPY_WORDS[width]))
    return _torch_digest(words, width)
