"""NumPy's generators as RNG sources, each with its own checkpoint form.

- :class:`NumpyRandomStateSource`: a legacy ``RandomState`` (by default
  NumPy's global one, behind ``np.random.seed``). Over ``MT19937`` its state
  is stored as ``"numpy-legacy"``: the 624 key words as an int64 tensor, plus
  position and cached Gaussian; over any other bit generator as
  ``"numpy-bitgen"``.
- :class:`NumpyGeneratorSource`: a ``Generator``'s bit generator, stored as
  ``"numpy-bitgen"``: its state dict, each array as raw bytes and dtype.

Every value read back is checked (:mod:`detctx._sources.checks`) before the
source is given it: NumPy accepts positions that crash the process.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

import detctx._sources.checks as checks
import detctx._sources.plain as plain
from detctx._sources.numpy_restore import capture_random_state, restore_random_state

__all__ = ["NumpyGeneratorSource", "NumpyRandomStateSource"]

_LEGACY, _BITGEN = "numpy-legacy", "numpy-bitgen"


class NumpyRandomStateSource:
    """A legacy ``np.random.RandomState``; by default NumPy's global one.

    The global one is looked up on first use: ``import numpy`` does not load
    ``numpy.random``, and importing detctx should not either.
    """

    checkpoint_kinds: ClassVar[frozenset[str]] = frozenset({_LEGACY, _BITGEN})

    def __init__(self, rng: np.random.RandomState | None = None) -> None:
        self._rng = rng

    def _target(self) -> np.random.RandomState:
        if self._rng is None:
            # np.random.seed/get_state/set_state are this object's bound methods.
            self._rng = np.random.mtrand._rand
        return self._rng

    @property
    def bit_generator(self) -> np.random.BitGenerator:
        """The bit generator under the ``RandomState``."""
        bit_generator: np.random.BitGenerator = self._target()._bit_generator
        return bit_generator

    def capture(self) -> Any:
        rng = self._target()
        # The legacy tuple exists for MT19937 only; asking it of another bit
        # generator warns (RuntimeWarning) and returns the dict anyway.
        if isinstance(rng._bit_generator, np.random.MT19937):
            return capture_random_state(rng)
        return rng.get_state(legacy=False)

    def restore(self, state: Any) -> None:
        restore_random_state(self._target(), state)

    def seed(self, seed: int) -> None:
        self._target().seed(seed)

    def seed_words(self, seed: int) -> None:
        """Seed from a 64-bit ``seed``, both its 32-bit words (``RandomState.seed`` of an
        array: the key-array initialisation; an int seed keeps 32 bits)."""
        self._target().seed((seed & 0xFFFFFFFF, seed >> 32))

    def to_checkpoint(self, state: Any) -> tuple[str, Any]:
        if not isinstance(state, tuple):
            return _BITGEN, plain.array_to_plain(state)
        bit_generator, key, pos, has_gauss, cached_gaussian = state
        return _LEGACY, {
            "bit_generator": str(bit_generator),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }

    def from_checkpoint(self, kind: str, stored: Any) -> Any:
        if kind == _BITGEN:
            state = plain.array_from_plain(stored)
            checks.check_bit_generator(state, self.bit_generator)
            return state
        stored = checks.check_fields(
            stored, "key", "bit_generator", "pos", "has_gauss", "cached_gaussian"
        )
        words = plain.tensor(stored["key"], torch.int64).numpy()
        checks.check_words(words, "key", checks.MT_WORDS)
        fields = (
            stored["bit_generator"],
            stored["pos"],
            stored["has_gauss"],
            stored["cached_gaussian"],
        )
        checks.check_numpy_legacy(*fields)
        if not isinstance(self.bit_generator, np.random.MT19937):
            raise checks.InvalidField(
                "bit_generator", f"this source's is {type(self.bit_generator).__name__}"
            )
        return (fields[0], words.astype(np.uint32), *fields[1:])


class NumpyGeneratorSource:
    """A ``np.random.Generator``; seeding gives the stream of ``default_rng``-style
    construction with the same bit generator type (``type(bg)(seed)``)."""

    checkpoint_kinds: ClassVar[frozenset[str]] = frozenset({_BITGEN})

    def __init__(self, rng: np.random.Generator) -> None:
        self._bit_generator = rng.bit_generator

    @property
    def bit_generator(self) -> np.random.BitGenerator:
        """The ``Generator``'s bit generator."""
        return self._bit_generator

    def capture(self) -> Any:
        return self._bit_generator.state

    def restore(self, state: Any) -> None:
        self._bit_generator.state = state

    def seed(self, seed: int) -> None:
        self._bit_generator.state = type(self._bit_generator)(seed).state

    def to_checkpoint(self, state: Any) -> tuple[str, Any]:
        return _BITGEN, plain.array_to_plain(state)

    def from_checkpoint(self, kind: str, stored: Any) -> Any:
        state = plain.array_from_plain(stored)
        checks.check_bit_generator(state, self._bit_generator)
        return state
