"""torch CPU generator states built from 64-bit seeds, for keyed worlds.

``torch.manual_seed(s)`` keeps 32 bits of ``s``: the CPU generator's
Mersenne Twister is initialised from ``s & 0xFFFFFFFF`` alone
(``at::mt19937``'s ``init_with_uint32``), so ``manual_seed(5)`` and
``manual_seed(5 + 2**32)`` give the same stream::

    python -c "import torch; g = torch.Generator(); a = g.manual_seed(5).get_state();
               print(torch.equal(torch.rand(3, generator=g.manual_seed(5)),
                                 torch.rand(3, generator=g.manual_seed(5 + 2**32))))"

A state holds the whole key, so a state built from the seed's
:func:`~detctx._basics.stream_keys` carries every bit of it. The state's
layout (``CPUGeneratorImplState``: the initial seed, ``left``, ``seeded``,
``next``, 624 key words of 64 bits, the cached normals; 5056 bytes, the same
from torch 1.x to 2.14) is checked once against ``manual_seed``'s own state;
a torch whose layout differs gets ``manual_seed`` and a warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any, Final

import numpy as np
import torch

from detctx._basics import DeterminismWarning, stream_keys, warn_at_user

__all__ = ["StateRows", "cpu_generator_states"]

_SIZE: Final = 5056
_KEY_AT: Final = 24
"""Where the 624 key words (each in 64 bits) start: after the initial seed, ``left``,
``seeded`` and ``next``."""


@cache
def _template() -> np.ndarray[Any, Any] | None:
    """A freshly seeded generator's state (``left`` 1: the next draw twists the key), or
    ``None`` when this torch's layout is not the one known here."""
    seed = 0x1234_5678
    state = torch.Generator().manual_seed(seed).get_state().numpy().copy()
    if state.size != _SIZE:
        return None
    head = state[:_KEY_AT].view(np.uint64)
    fields = state[8:16].view(np.int32)
    key = state[_KEY_AT : _KEY_AT + 8 * 624].view(np.uint64)
    # init_genrand's first two words, as torch and every Mersenne Twister compute them.
    second = (1812433253 * (seed ^ (seed >> 30)) + 1) & 0xFFFFFFFF
    if (int(head[0]), *map(int, fields), int(head[2])) != (seed, 1, 1, 0) or (
        int(key[0]),
        int(key[1]),
    ) != (seed, second):
        return None
    return state


def cpu_generator_states(seeds: Sequence[int]) -> list[torch.Tensor] | None:
    """The CPU generator states of 64-bit ``seeds`` (``initial_seed()`` reports the seed), for
    ``set_state``; ``None`` on a torch whose state layout is unknown (warned once)."""
    return StateRows().fill(seeds)


class StateRows:
    """Rows of CPU generator states, reused from one batch of seeds to the next: allocating a
    state and wrapping it in a tensor cost more than deriving its key."""

    __slots__ = ("_array", "_rows")

    def __init__(self) -> None:
        self._array: np.ndarray[Any, Any] | None = None
        self._rows: list[torch.Tensor] = []

    def fill(self, seeds: Sequence[int]) -> list[torch.Tensor] | None:
        """The states of ``seeds``, in rows that the next ``fill`` overwrites (``set_state``
        copies a state: use them before); ``None`` when the layout is unknown."""
        template = _template()
        if template is None:
            _warn_unknown_layout()
            return None
        count = len(seeds)
        if self._array is None or len(self._array) < count:
            self._array = np.repeat(template[None, :], max(count, 2 * len(self._rows)), axis=0)
            # One tensor per row, each starting at its own data: set_state on a row *view* of
            # a 2-D tensor (a storage offset) crashed torch 2.13 (segmentation fault).
            self._rows = [torch.from_numpy(row) for row in self._array]
        states = self._array[:count]
        states[:, :8].view(np.uint64)[:, 0] = np.array(seeds, dtype=np.uint64)
        states[:, _KEY_AT : _KEY_AT + 8 * 624].view(np.uint64)[:] = stream_keys(seeds)
        return self._rows[:count]


@cache
def _warn_unknown_layout() -> None:
    warn_at_user(
        f"torch {torch.__version__}'s CPU generator state has a layout detctx does not know: "
        "keyed streams (elastic loaders, keyed collators) seed torch with manual_seed, which "
        "keeps 32 bits of each 64-bit seed, so two samples' torch draws can coincide. "
        "Report it with your torch version",
        DeterminismWarning,
    )
