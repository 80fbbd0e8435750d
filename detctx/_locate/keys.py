"""The secret behind a digest: the weights and multipliers it draws from a key.

Every constant of the digest (:mod:`detctx._locate.digest`) comes from a
:class:`DigestKey`: the odd 8-bit weights of each reduce step and the two
streams of odd 64-bit multipliers of the sums. Both steps are linear in the
tensor's bytes, so a program that knows the constants can solve for a
difference that cancels (a kernel vector of the first reduce step, found by
lattice reduction in seconds) and make two different tensors share a digest.
With constants drawn from a secret 128-bit key, a difference chosen without
the key is missed only as often as a random one (see the digest's bounds);
a program that reads the key (from its environment before detctx removes
it, or from the process's memory) can still craft a collision.

:func:`process_key` is this process's key: 16 bytes from the operating
system (``secrets``, never a seeded generator, so no RNG stream of the
user's program moves), made at first use. Every recording in the process
uses it, so the runs of ``locate_divergence`` compare. ``detctx run
--locate`` makes one key for all its runs and hands it to each through
:data:`KEY_ENV`; :func:`use_key` installs it before anything is digested.
:data:`PUBLIC_KEY` is the fixed key of digests that are compared across
processes that share no key (``detctx compare``'s recordings).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
from typing import Final

import numpy as np
import torch

from detctx._basics import TraceError

__all__ = [
    "COLUMNS",
    "KEY_BYTES",
    "KEY_ENV",
    "PUBLIC_KEY",
    "ROW_BYTES",
    "WORDS",
    "DigestKey",
    "process_key",
    "use_key",
]

ROW_BYTES: Final = 8192
COLUMNS: Final = 8
WORDS: Final = 1 << 13
"""Multipliers in each stream: enough for the largest sums (``SUMMED`` bytes)."""
KEY_BYTES: Final = 16
KEY_ENV: Final = "DETCTX_LOCATE_KEY"
"""The variable through which ``detctx run --locate`` hands its runs the key (hex)."""
_FEW: Final = 8
_HEX: Final = re.compile(f"[0-9a-f]{{{2 * KEY_BYTES}}}")


def _odd_words(key: bytes, label: bytes, count: int) -> np.ndarray:
    """``count`` odd 64-bit words drawn from ``key`` (SHAKE-256 of the key and a label)."""
    stream = hashlib.shake_256(key + label).digest(8 * count)
    words: np.ndarray = np.frombuffer(stream, dtype="<u8").astype(np.uint64) | np.uint64(1)
    return words


class DigestKey:
    """The constants of one key, made on first use and kept (per device for torch's).

    ``DigestKey(bytes)`` for a 16-byte key; :data:`PUBLIC_KEY` has none
    (its constants are fixed and published).
    """

    def __init__(self, key: bytes | None) -> None:
        if key is not None and (type(key) is not bytes or len(key) != KEY_BYTES):
            raise ValueError(f"a digest key is {KEY_BYTES} bytes")
        self._key = key
        self._lock = threading.Lock()
        self._streams: dict[int, np.ndarray] = {}
        self._torch_streams: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._weights: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.few: tuple[list[int], list[int]] = (
            [int(m) for m in self.stream(0)[:_FEW]],
            [int(m) for m in self.stream(1)[:_FEW]],
        )

    def hex(self) -> str:
        """The key as 32 hex digits (what :data:`KEY_ENV` carries); the public key has none."""
        if self._key is None:
            raise ValueError("the public digest key is not secret and is not handed on")
        return self._key.hex()

    def _words(self, label: int, count: int) -> np.ndarray:
        if self._key is None:
            return _public_words(label, count)
        return _odd_words(self._key, b"detctx-digest-%d" % label, count)

    def stream(self, which: int) -> np.ndarray:
        """Stream ``which`` (0: the multipliers ``a``, 1: ``c``) as :data:`WORDS` odd uint64."""
        found = self._streams.get(which)
        if found is None:
            with self._lock:
                found = self._streams.setdefault(which, self._words(which, WORDS))
        return found

    def torch_stream(self, which: int, device: torch.device) -> torch.Tensor:
        """:meth:`stream` as int64 on ``device``."""
        found = self._torch_streams.get((which, device))
        if found is None:
            signed = torch.from_numpy(self.stream(which).view(np.int64)).to(device)
            with self._lock:
                found = self._torch_streams.setdefault((which, device), signed)
        return found

    def weights(self, stage: int, device: torch.device) -> torch.Tensor:
        """Reduce step ``stage``'s ``ROW_BYTES x COLUMNS`` matrix of odd int8 weights."""
        found = self._weights.get((stage, device))
        if found is None:
            words = self._words(2 + stage, ROW_BYTES * COLUMNS)
            low = (words & np.uint64(0xFF)).astype(np.uint8)
            matrix = torch.from_numpy(low.view(np.int8).reshape(ROW_BYTES, COLUMNS)).to(device)
            with self._lock:
                found = self._weights.setdefault((stage, device), matrix)
        return found


_GAMMA: Final = 0x9E3779B97F4A7C15
_MIX1: Final = 0xBF58476D1CE4E5B9
_MIX2: Final = 0x94D049BB133111EB


def _public_words(label: int, count: int) -> np.ndarray:
    """The public key's words: splitmix64 from a start per label, far apart (none overlap)."""
    start = label << 40 if label < 2 else (2 << 40) + (label - 2) * ROW_BYTES * COLUMNS
    z = np.arange(start + 1, start + count + 1, dtype=np.uint64) * np.uint64(_GAMMA)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    result: np.ndarray = z | np.uint64(1)
    return result


PUBLIC_KEY: Final = DigestKey(None)
"""Fixed, published constants: for digests compared where no key is shared."""

_process_key: DigestKey | None = None
_process_lock = threading.Lock()


def process_key() -> DigestKey:
    """This process's secret key, made from the operating system's entropy at first use."""
    global _process_key
    if _process_key is None:
        with _process_lock:
            if _process_key is None:
                _process_key = DigestKey(secrets.token_bytes(KEY_BYTES))
    return _process_key


def use_key(text: str) -> DigestKey:
    """Make ``text`` (32 lowercase hex digits, as :data:`KEY_ENV` carries it) this process's
    key; refused (:class:`~detctx.TraceError`, nothing changed) when it is not such a text or
    when this process has digested with another key already."""
    global _process_key
    if type(text) is not str or not _HEX.fullmatch(text):
        raise TraceError(
            f"${KEY_ENV} must be {2 * KEY_BYTES} lowercase hex digits (detctx run --locate "
            f"sets it), got {str(text)[:40]!r}"
        )
    key = DigestKey(bytes.fromhex(text))
    with _process_lock:
        if _process_key is not None and _process_key._key != key._key:
            raise TraceError(
                "this process has digested tensors with another key already; the key must "
                "be set before recording starts"
            )
        _process_key = key
    return key
