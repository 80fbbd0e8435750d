"""Seed validation, resolution and collision-free derivation."""

from __future__ import annotations

import operator
import os
from typing import Final

import numpy as np

__all__ = [
    "DEFAULT_SEED",
    "MAX_SEED",
    "SEED_ENV",
    "derive_seed",
    "fresh_seed",
    "resolve_seed",
    "validate_seed",
]

DEFAULT_SEED: Final = 1234
"""MindSpeed-LLM's default seed."""

MAX_SEED: Final = 2**32 - 1
"""The largest seed NumPy's legacy global generator accepts."""

SEED_ENV: Final = "DETCTX_SEED"
"""Environment variable read when ``seed=None``."""


def validate_seed(seed: object, what: str = "seed") -> int:
    """Return ``seed`` as an ``int`` in ``[0, 2**32 - 1]``.

    Python and NumPy integers are accepted. ``bool``, floats and strings raise
    ``TypeError``; integers out of range raise ``ValueError``.
    """
    if isinstance(seed, (bool, np.bool_)):
        raise TypeError(f"{what} must be an integer, not a bool ({seed!r})")
    try:
        value = operator.index(seed)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{what} must be an integer in [0, {MAX_SEED}], not {type(seed).__name__} ({seed!r})"
        ) from None
    if not 0 <= value <= MAX_SEED:
        raise ValueError(
            f"{what} must be in [0, {MAX_SEED}] (NumPy's legacy generator's range), got {value}"
        )
    return value


def fresh_seed() -> int:
    """A new seed drawn from OS entropy (never from a seeded RNG)."""
    return int.from_bytes(os.urandom(4), "little")


def resolve_seed(seed: int | None) -> int:
    """The seed to use: ``seed`` itself, else ``$DETCTX_SEED``, else a fresh one.

    ``seed`` must already have been validated.
    """
    if seed is not None:
        return seed
    from_env = os.environ.get(SEED_ENV)
    if from_env is None or from_env.strip() == "":
        return fresh_seed()
    try:
        value = int(from_env.strip(), 0)
    except ValueError:
        raise ValueError(
            f"{SEED_ENV}={from_env!r} is not an integer; set it to a seed in [0, {MAX_SEED}] "
            f"or unset it to draw a fresh seed"
        ) from None
    return validate_seed(value, f"{SEED_ENV}")


def derive_seed(seed: int, *key: int) -> int:
    """A seed for a sub-stream, derived from ``seed`` and a spawn key.

    ``derive_seed(s, rank)`` gives each rank its own stream. Unlike
    ``seed + rank`` (or Megatron's ``seed + 100 * pp_rank`` offsets) the
    derivation hashes ``(seed, key)`` through NumPy's ``SeedSequence``, so
    different ``(seed, key)`` pairs do not collide in practice, and the same
    pair always gives the same seed on any machine.
    """
    seed = validate_seed(seed)
    spawn_key = tuple(validate_seed(k, "spawn key element") for k in key)
    state = np.random.SeedSequence(seed, spawn_key=spawn_key).generate_state(1, np.uint32)
    return int(state[0])
