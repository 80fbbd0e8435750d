"""Bit-exact digests of tensors, computed where the tensor lives.

A digest is a 64-bit integer. The tensor's bits are read as unsigned words
(1, 2, 4 or 8 bytes, the element size; 16-byte elements as two 8-byte words),
each word ``w_i`` at flat position ``i`` goes through a bijection of 64-bit
integers, ``f(w) = g(w * C)`` with ``g(x) = x ^ (x >> 29)`` (a logical shift),
and is multiplied by an odd, position-dependent ``m_i``; the digest is the sum
of those products modulo ``2**64``.

Why a one-element change always changes the digest: ``f`` is a bijection, so
a changed word gives a changed ``f(w_i)``; its product with the odd ``m_i``
changes by ``delta * m_i``, which is never ``0`` modulo ``2**64`` because an
odd number is invertible modulo a power of two. Changes in several elements
could cancel only by a 2**-64 accident, not by structure: the sum of plain
words is not what is added up. Positions matter (a permutation changes the
digest), and ``-0.0`` / ``0.0`` or two NaN payloads differ, as the bits do.

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
_SCRAMBLE: Final = 0xBF58476D1CE4E5B9
_STEP: Final = 0x9E3779B97F4A7C15
_OFFSET: Final = 0xD1B54A32D192ED03
_SHIFT: Final = 29
_CACHED_POSITIONS: Final = 1 << 20
"""Multipliers are cached for tensors up to this many words; larger ones build theirs."""

_WORDS: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
_NUMPY_WORDS: Final = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}

_numpy_multipliers: np.ndarray = np.zeros(0, dtype=np.uint64)
_torch_multipliers: dict[torch.device, torch.Tensor] = {}


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _numpy_positions(count: int) -> np.ndarray:
    global _numpy_multipliers
    if count <= len(_numpy_multipliers):
        return _numpy_multipliers[:count]
    size = count if count > _CACHED_POSITIONS else min(_CACHED_POSITIONS, max(count, 1024) * 2)
    with np.errstate(over="ignore"):
        made = np.arange(size, dtype=np.uint64) * np.uint64(_STEP) + np.uint64(_OFFSET)
    made |= np.uint64(1)
    if size <= _CACHED_POSITIONS:
        _numpy_multipliers = made
    return made[:count]


def _torch_positions(count: int, device: torch.device) -> torch.Tensor:
    cached = _torch_multipliers.get(device)
    if cached is not None and count <= cached.numel():
        return cached[:count]
    size = count if count > _CACHED_POSITIONS else min(_CACHED_POSITIONS, max(count, 1024) * 2)
    made = torch.arange(size, dtype=torch.int64, device=device) * _signed(_STEP) + _signed(_OFFSET)
    made |= 1
    if size <= _CACHED_POSITIONS:
        _torch_multipliers[device] = made
    return made[:count]


def digest_words(words: np.ndarray) -> int:
    """The digest of unsigned integer words (any width up to 64 bits), in NumPy."""
    wide = words.astype(np.uint64, copy=False).reshape(-1)
    with np.errstate(over="ignore"):
        mixed = wide * np.uint64(_SCRAMBLE)
        mixed ^= mixed >> np.uint64(_SHIFT)
        mixed *= _numpy_positions(len(wide))
        return int(mixed.sum(dtype=np.uint64))


def _torch_digest(words: torch.Tensor, width: int) -> int:
    wide = words.reshape(-1).to(torch.int64)
    if width < 8:
        # Zero-extend: torch widens signed words with their sign, NumPy's unsigned ones do not.
        wide &= (1 << (8 * width)) - 1
    # torch has no unsigned 64-bit arithmetic before 2.3; int64 multiplication and
    # sums wrap modulo 2**64, and masking the shifted value makes the shift logical.
    mixed = wide * _signed(_SCRAMBLE)
    mixed ^= (mixed >> _SHIFT) & ((1 << (64 - _SHIFT)) - 1)
    mixed *= _torch_positions(mixed.numel(), mixed.device)
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
