"""Seeds: validation, the one parser for seed text, resolution, and every rule that derives
one seed from another (for ranks, layouts, loaders, workers, tests, keyed batches, and
Megatron's own offsets, which detctx reproduces), so that the rules are read in one place."""

from __future__ import annotations

import functools
import hashlib
import operator
import os
import sys
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:  # NumPy is imported where it is used: `detctx run`'s parent has none
    import numpy as np

__all__ = [
    "CAUSES_OF_A_DIFFERENT_START",
    "DEFAULT_SEED",
    "MAX_SEED",
    "SEED_ENV",
    "as_integer",
    "content_seed",
    "derive_seed",
    "fresh_seed",
    "group_seed",
    "indexed_seed",
    "indexed_seeds",
    "indexed_words",
    "loader_seed",
    "megatron_stage_seed",
    "megatron_tracker_seeds",
    "mesh_seed",
    "node_seed",
    "parse_seed",
    "resolve_seed",
    "stream_keys",
    "validate_seed",
    "worker_seed",
]

DEFAULT_SEED: Final = 1234
"""MindSpeed-LLM's default seed."""

MAX_SEED: Final = 2**32 - 1
"""The largest seed NumPy's legacy global generator accepts."""

SEED_ENV: Final = "DETCTX_SEED"
"""Environment variable read when ``seed=None``."""

CAUSES_OF_A_DIFFERENT_START: Final = (
    "nothing seeds the run: wrap the training in `with detctx.deterministic(seed=...)` or "
    "call detctx.seed_all(...) first (detctx run exports DETCTX_SEED, which "
    "deterministic(seed=None) reads, but a script has to enter the block)",
    "the model or the data was created before the block or the seed: create whatever "
    "draws random numbers (the model's initial weights, a random split, the DataLoader "
    "and its shuffling) inside the block",
    "something read entropy at start-up: an unseeded random.Random(), "
    "np.random.default_rng() or torch.Generator(), os.urandom, the clock; derive it from "
    "the run's seed or register it with detctx.register_source",
)
"""Why two runs differ from their first metric value or their first random draw, the most
common cause first: they did not start from the same state."""


def _is_array(value: object) -> bool:
    # A tensor or an array converts with operator.index when it holds one integer
    # (torch.tensor([3]) and torch.tensor(True) too): refused, not read as a number.
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return (torch is not None and isinstance(value, torch.Tensor)) or (
        np is not None and isinstance(value, np.ndarray)
    )


def as_integer(value: object) -> int | None:
    """``value`` as an ``int`` when it is an integer, Python's or NumPy's (``np.int64(2)``);
    else ``None``. A bool is not an integer here, NumPy's ``np.bool_`` neither, nor is a
    tensor or an array."""
    np = sys.modules.get("numpy")
    if isinstance(value, bool) or (np is not None and isinstance(value, np.bool_)):
        return None
    if _is_array(value):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def validate_seed(seed: object, what: str = "seed") -> int:
    """Return ``seed`` as an ``int`` in ``[0, 2**32 - 1]``.

    Python and NumPy integers are accepted. ``bool``, floats, strings, tensors
    and arrays (``torch.tensor(3)`` too: pass ``seed.item()``) raise
    ``TypeError``; integers out of range raise ``ValueError``.
    """
    # NumPy is imported only where it is needed (0.1 s; `--detctx-seed` parses seeds before
    # anything else is loaded): a NumPy bool can exist only once NumPy is imported.
    np = sys.modules.get("numpy")
    if isinstance(seed, bool) or (np is not None and isinstance(seed, np.bool_)):
        raise TypeError(f"{what} must be an integer, not a bool ({seed!r})")
    if _is_array(seed):
        raise TypeError(
            f"{what} must be a Python or NumPy integer, not a "
            f"{type(seed).__module__.split('.')[0]}.{type(seed).__name__} ({seed!r}); "
            "pass its value (.item())"
        )
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


def parse_seed(text: str, what: str = "seed", *, maximum: int = MAX_SEED) -> int:
    """The seed written in ``text`` (an environment variable, a command-line option).

    The one rule for seed text everywhere (``$DETCTX_SEED``, ``--detctx-seed``,
    ``detctx run --seed``, ``$RANK``-like variables, a recording's portable seed with
    ``maximum=2**64 - 1``): ASCII decimal digits only, leading zeros allowed,
    surrounding spaces and tabs ignored, in ``[0, maximum]`` (``[0, 2**32 - 1]``
    unless told). Anything else (``'abc'``, ``'-1'``, ``'0x2a'``, ``'1_000'``, the
    Arabic-Indic ``'٣'``, an out-of-range number) raises the same ``ValueError``
    naming ``what``::

        from detctx._basics.seeds import parse_seed
        parse_seed("0042")            # 42
        parse_seed("1_000", "--seed")  # ValueError: --seed='1_000' is not valid: ...
    """
    if not isinstance(text, str):
        raise TypeError(f"{what} must be text (a str), not {type(text).__name__} ({text!r})")
    digits = text.strip(" \t\r\n")
    # str.isdigit and int() accept any Unicode digit ('٣' is 3) and int() accepts
    # '1_000', '+5' and ' 5 ': test for ASCII 0-9 ourselves. Leading zeros are
    # dropped before the length check, so 10,000 zeros do not reach int().
    significant = digits.lstrip("0")
    if (
        not digits
        or not digits.isascii()
        or not digits.isdigit()
        or len(significant) > len(str(maximum))
        or int(significant or "0") > maximum
    ):
        shown = repr(text) if len(text) <= 40 else f"{text[:32]!r}... ({len(text)} characters)"
        raise ValueError(
            f"{what}={shown} is not valid: expected an integer in [0, {maximum}] written "
            f"in ASCII decimal digits (0-9)"
        )
    return int(significant or "0")


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
        return parse_seed(from_env, SEED_ENV)
    except ValueError as exc:
        raise ValueError(f"{exc}; set it to such a seed or unset it to draw a fresh one") from None


def derive_seed(seed: int, *key: int) -> int:
    """A seed for a sub-stream, derived from ``seed`` and a spawn key.

    ``derive_seed(s, rank)`` gives each rank its own stream. Unlike
    ``seed + rank`` (or Megatron's ``seed + 100 * pp_rank`` offsets) the
    derivation hashes ``(seed, key)`` through NumPy's ``SeedSequence``, so
    different ``(seed, key)`` pairs do not collide in practice, and the same
    pair always gives the same seed on any machine.
    """
    import numpy as np

    seed = validate_seed(seed)
    spawn_key = tuple(validate_seed(k, "spawn key element") for k in key)
    state = np.random.SeedSequence(seed, spawn_key=spawn_key).generate_state(1, np.uint32)
    return int(state[0])


_GOLDEN: Final = 0x9E3779B97F4A7C15
_MASK: Final = 2**64 - 1


def indexed_seeds(base: int, indices: Sequence[int] | np.ndarray[Any, Any]) -> list[int]:
    """The 64-bit seeds of items ``indices`` of a family of streams keyed by ``base``, about
    10 us for 32 of them.

    ``base`` is a seed of up to 64 bits (``indexed_seed(derive_seed(s, KEY),
    epoch)``: one family per epoch), each index an integer in ``[0, 2**64 -
    1]`` (a sample's index). Each ``(base, index)`` goes through SplitMix64's
    finaliser (the mixer that seeds xoshiro and Java's ``SplittableRandom``),
    a bijection of 64-bit words, so the indices of one base never share a
    seed, and the families of two bases meet only by chance (about ``n**2 /
    2**65`` pairs among ``n`` seeds); the result is the same on every machine.
    It is :func:`derive_seed` for callers that need a seed per sample, a
    batch at a time: ``SeedSequence`` costs about 16 us a call. A seed of 64
    bits seeds a stream only through :func:`stream_keys` (or an RNG that reads
    every bit, as Python's ``random.seed`` does): ``torch.manual_seed`` keeps
    32 of them.
    """
    import numpy as np

    seeds: list[int] = _indexed(base, np.array(indices, dtype=np.uint64)).tolist()
    return seeds


def indexed_words(base: int, count: int) -> np.ndarray[Any, Any]:
    """``indexed_seeds(base, range(count))`` as a uint64 array: a portable random op's
    words, one or two per element (10 to 20 ns a word on one core of the test machine)."""
    import numpy as np

    return _indexed(base, np.arange(count, dtype=np.uint64))


def _indexed(base: int, z: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # Array arithmetic wraps modulo 2**64 without a warning (scalar arithmetic would warn,
    # so the base's product is taken in Python), and np.errstate costs more than the mixing.
    # In place, with one scratch array: the sampler derives a thousand seeds at a time.
    import numpy as np

    z += np.uint64(base * _GOLDEN & _MASK)
    _finalise(z)
    return z


def _finalise(z: np.ndarray[Any, Any]) -> None:
    # SplitMix64's finaliser, in place over uint64 words.
    import numpy as np

    u64 = np.uint64
    scratch = z >> u64(30)
    z ^= scratch
    z *= u64(0xBF58476D1CE4E5B9)
    np.right_shift(z, u64(27), out=scratch)
    z ^= scratch
    z *= u64(0x94D049BB133111EB)
    np.right_shift(z, u64(31), out=scratch)
    z ^= scratch


def indexed_seed(base: int, index: int) -> int:
    """``indexed_seeds(base, [index])[0]`` in Python's integers: one 64-bit seed of the
    family, about 1 us (a NumPy call costs more for a single item)."""
    z = (index + base * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


_MT_WORDS: Final = 624
"""The 32-bit words of a Mersenne Twister's key (Python's, NumPy's legacy, torch's CPU one)."""


def stream_keys(seeds: Sequence[int]) -> np.ndarray[Any, Any]:
    """The Mersenne Twister keys of 64-bit ``seeds``: a ``(len(seeds), 624)`` uint32 array, row
    ``i`` the first 312 words of the SplitMix64 stream of ``seeds[i]`` (how xoshiro's authors
    fill a large state from one word), one NumPy pass over a batch's seeds.

    For a generator whose own seeding reads 32 bits (``torch.manual_seed``: two seeds that
    differ only above bit 31 give the same stream): a key is a whole state, so every bit of
    the seed reaches the stream, and two seeds give keys that share no word but by chance.
    """
    import numpy as np

    z: np.ndarray[Any, Any] = np.array(seeds, dtype=np.uint64).reshape(-1, 1) + _steps()
    _finalise(z)
    return z.view(np.uint32)


@functools.cache
def _steps() -> np.ndarray[Any, Any]:
    # The counters of a SplitMix64 stream: its first 312 increments of the golden gamma.
    import numpy as np

    steps: np.ndarray[Any, Any] = np.arange(1, _MT_WORDS // 2 + 1, dtype=np.uint64)
    steps *= np.uint64(_GOLDEN)
    return steps


def group_seed(seed: int, **coordinates: int) -> int:
    """A seed for the stream of one position in a parallel layout.

    ``group_seed(s, tp=tp_rank)`` gives every tensor-parallel rank its own
    stream, shared by the data-parallel replicas of that rank;
    ``group_seed(s, pp=pp_rank, tp=tp_rank, dp=dp_rank)`` one per rank. The
    coordinates' names and values are hashed together with ``seed`` through
    :func:`derive_seed`, in name order, so the result does not depend on
    argument order, and, unlike Megatron's ``seed + 100 * pp_rank + 10 *
    dp_rank`` offsets, different layouts and positions do not collide in
    practice. Values are integers in ``[0, 2**32 - 1]``::

        tp_seed = detctx.group_seed(1234, tp=tp_rank)
    """
    seed = validate_seed(seed)
    if not coordinates:
        raise TypeError("group_seed needs at least one coordinate, e.g. group_seed(seed, tp=0)")
    key: list[int] = []
    for name in sorted(coordinates):
        key.append(_name_key(name))
        key.append(validate_seed(coordinates[name], f"coordinate {name}"))
    return derive_seed(seed, *key)


def _name_key(name: str) -> int:
    # A stable 32-bit code for a coordinate name (Python's hash() is salted per process).
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


def content_seed(seed: int, epoch: int | None, digest: bytes) -> int:
    """The 64-bit seed of a keyed collator's world: ``seed``, ``epoch`` (``None``: left out)
    and a digest of the batch's contents hashed together through ``SeedSequence``."""
    import numpy as np

    words = [seed, -1 if epoch is None else epoch]
    words += [int.from_bytes(digest[i : i + 4], "little") for i in range(0, len(digest), 4)]
    sequence = np.random.SeedSequence([word & 0xFFFFFFFF for word in words])
    return int(sequence.generate_state(1, np.uint64)[0])


_LOADER_KEY: Final = zlib.crc32(b"detctx.loader_generator")


def loader_seed(base: int, rank: int) -> int:
    """The 64-bit seed of ``loader_generator``'s generator for ``base`` and ``rank``."""
    import numpy as np

    words = np.random.SeedSequence(base, spawn_key=(_LOADER_KEY, rank)).generate_state(2, np.uint32)
    return int(words[0]) | int(words[1]) << 32


def worker_seed(base_seed: int, worker_id: int, rank: int, source: str) -> int:
    """The seed ``seed_worker`` gives the RNG source named ``source`` in a loader worker."""
    import numpy as np

    key = zlib.crc32(source.encode())
    sequence = np.random.SeedSequence([base_seed, worker_id, rank], spawn_key=(key,))
    return int(sequence.generate_state(1, np.uint32)[0])


def node_seed(session_seed: int, nodeid: str) -> int:
    """The seed ``--detctx-seed session_seed`` gives the test ``nodeid``.

    It depends only on the two (a hash of the node id, not the run order or
    the worker), so rerunning a single test with the same ``--detctx-seed``,
    with or without pytest-xdist, gives it the same seed.
    """
    digest = hashlib.blake2b(nodeid.encode("utf-8"), digest_size=8).digest()
    key = (int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little"))
    return derive_seed(session_seed, *key)


def megatron_stage_seed(seed: int, pp_rank: int, dp_rank: int | None) -> int:
    """Megatron's ``_set_random_seed``: ``seed + 100 * pp_rank`` (``+ 10 * dp_rank``), taken
    modulo ``2**32`` where it would pass NumPy's limit (Megatron itself fails there)."""
    offset = 100 * pp_rank + (0 if dp_rank is None else 10 * dp_rank)
    return (seed + offset) % (MAX_SEED + 1)


def megatron_tracker_seeds(
    seed: int, tp_rank: int, ep_rank: int, etp_rank: int
) -> tuple[int, int, int]:
    """Megatron's ``model_parallel_cuda_manual_seed``: the data-parallel, model-parallel and
    expert-parallel states' seeds (``seed``, ``seed + 2718 + tp_rank``, ``seed + 1024 + 100 *
    ep_rank + etp_rank``)."""
    return seed, seed + 2718 + tp_rank, seed + 1024 + 100 * ep_rank + etp_rank


def mesh_seed(seed: int, local_ranks: Sequence[int], sizes: Sequence[int]) -> int:
    """torchtitan's ``set_determinism``: ``seed + sum(local_rank[i] * prod(sizes[:i]))`` over the
    distinct mesh dims in order, taken modulo ``2**32`` where it would pass NumPy's limit
    (torchtitan wraps at ``2**64``, as torch's seed does)."""
    offset, stride = 0, 1
    for local_rank, size in zip(local_ranks, sizes):
        offset += local_rank * stride
        stride *= size
    return (seed + offset) % (MAX_SEED + 1)
