"""Seed agreement: every rank of a group learns every rank's seed in one ``all_gather``.

Each rank sends ``[seed, kind, per_rank]``: so ranks that passed different
seeds (or mixed ``None`` and explicit seeds, or different ``per_rank``) all
raise the same :class:`~detctx.SeedMismatchError` after the same
collective, and none is left waiting for a rank that already gave up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from detctx._errors import SeedMismatchError
from detctx._seeds import (
    SEED_ENV,
    as_integer,
    derive_seed,
    group_seed,
    resolve_seed,
    validate_seed,
)
from detctx._settings import Seeding
from detctx.distributed._arrival import (
    DEFAULT_TIMEOUT_S,
    check_timeout,
    gather_rows,
    ranks_by_label,
    ranks_text,
)
from detctx.distributed._topology import in_process_group, rank_and_size

__all__ = [
    "Agreement",
    "DistributedSeeding",
    "agree",
    "agree_seed",
    "check_arguments",
    "decide",
    "grouped",
]

_EXPLICIT, _DRAWN, _UNRESOLVED = 1, 0, -1


@dataclass(frozen=True)
class DistributedSeeding(Seeding):
    """What one entry of :class:`distributed_deterministic` applied on this rank.

    ``seed`` is the seed this rank's RNGs were seeded with: ``shared_seed``
    itself, or with ``per_rank=True`` ``derive_seed(shared_seed, rank)``.
    ``shared_seed`` is the seed all ranks agreed on; rerun with
    ``distributed_deterministic(seed=seeding.shared_seed, ...)`` on the same world
    size to repeat the run. ``rank`` and ``world_size`` are within the block's
    group (0 and 1 outside a process group); ``group`` is that process group
    (``None``: the default group).
    """

    shared_seed: int
    rank: int
    world_size: int
    per_rank: bool
    group: Any = field(default=None, repr=False, compare=False)

    def group_seed(self, **coordinates: int) -> int:
        """:func:`~detctx._seeds.group_seed` of the shared seed, e.g. ``run.group_seed(tp=0)``."""
        return group_seed(self.shared_seed, **coordinates)

    def describe(self) -> str:
        stream = "per-rank stream" if self.per_rank else "same stream on every rank"
        return (
            f"{super().describe()}; rank {self.rank} of {self.world_size}, "
            f"shared seed {self.shared_seed}, {stream}"
        )


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on for one entry: this rank's seed and where it stands."""

    seed: int
    shared_seed: int
    rank: int
    world_size: int


def agree_seed(
    seed: int | None = None,
    *,
    group: Any = None,
    src: int = 0,
    per_rank: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> int:
    """The seed every rank of ``group`` agrees on, in one ``all_gather``.

    With ``seed=None`` the source rank ``src`` (a global rank, as in
    ``torch.distributed.broadcast``) reads ``$DETCTX_SEED`` or draws a fresh
    seed, and every rank gets it. With an explicit seed every rank checks that
    all ranks passed the same one (and the same ``per_rank``); if not, every
    rank raises the same :class:`~detctx.SeedMismatchError`. Nothing is
    seeded. Outside a process group, returns the resolved seed.

    Each rank waits at most ``timeout`` seconds for the others; if some never
    arrive, every waiting rank raises :class:`~detctx.SeedAgreementError`
    naming them, instead of waiting for the process group's own timeout::

        seed = detctx.agree_seed(None, timeout=60.0)

    This is the agreement step of :class:`distributed_deterministic` alone.
    """
    checked = check_arguments(seed, per_rank, group, src)
    return agree(checked, per_rank, group, src, check_timeout(timeout)).shared_seed


def check_arguments(seed: object, per_rank: object, group: object, src: object) -> int | None:
    """``seed`` validated, after checking ``per_rank``, ``group`` and ``src`` (else raise)."""
    checked = None if seed is None else validate_seed(seed)
    if not isinstance(per_rank, bool):
        raise TypeError(f"per_rank must be True or False, got {per_rank!r}")
    rank = as_integer(src)
    if rank is None:
        raise TypeError(f"src must be a global rank (an int), got {src!r}")
    if rank < 0:
        raise ValueError(f"src must be a global rank (>= 0), got {src}")
    if group is not None:
        dist = torch.distributed
        process_group = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
        if process_group is None or not isinstance(group, process_group):
            raise TypeError(
                f"group must be a torch.distributed ProcessGroup or None (the default group), "
                f"got {type(group).__name__}"
            )
    return checked


def agree(
    seed: int | None, per_rank: bool, group: Any, src: int, timeout: float = DEFAULT_TIMEOUT_S
) -> Agreement:
    """Agree with the other ranks on the seed of one entry (arguments already checked)."""
    if not in_process_group():
        shared = resolve_seed(seed)
        return Agreement(derive_seed(shared, 0) if per_rank else shared, shared, 0, 1)
    rank, world_size = rank_and_size(group)
    src_rank = _group_rank(group, int(src))  # a NumPy integer too (check_arguments)
    failure: ValueError | None = None
    if seed is not None:
        row = [seed, _EXPLICIT, int(per_rank)]
    elif rank == src_rank:
        try:
            row = [resolve_seed(None), _DRAWN, int(per_rank)]
        except ValueError as exc:
            # Raising here alone would leave every other rank waiting in the gather.
            failure = exc
            row = [-1, _UNRESOLVED, int(per_rank)]
    else:
        row = [-1, _DRAWN, int(per_rank)]
    rows = (
        [row]
        if world_size == 1
        else gather_rows(row, group, rank, world_size, timeout, "the seed agreement")
    )
    try:
        shared = decide(rows, src_rank)
    except ValueError as exc:
        if failure is not None:
            raise exc from failure
        raise
    return Agreement(derive_seed(shared, rank) if per_rank else shared, shared, rank, world_size)


def _group_rank(group: Any, src: int) -> int:
    dist = torch.distributed
    get_group_rank = getattr(dist, "get_group_rank", None)
    if get_group_rank is None:  # torch without it: only the default group is translatable
        group_rank = src if group is None else -1
    else:
        try:
            group_rank = int(get_group_rank(dist.group.WORLD if group is None else group, src))
        except (RuntimeError, ValueError):
            group_rank = -1
    if not 0 <= group_rank < dist.get_world_size(group):
        raise ValueError(
            f"src={src} is not a rank of the process group; pass the global rank of one of "
            f"its members"
        )
    return group_rank


def decide(rows: list[list[int]], src_rank: int) -> int:
    """The agreed seed from every rank's ``[seed, kind, per_rank]`` row, or the same error."""
    seeds = tuple(None if kind != _EXPLICIT else value for value, kind, _ in rows)
    per_rank = tuple(bool(flag) for _, _, flag in rows)
    if len(set(per_rank)) > 1:
        raise SeedMismatchError(
            "the ranks disagree on per_rank: "
            + grouped([f"per_rank={flag}" for flag in per_rank])
            + ". Pass the same per_rank on every rank.",
            seeds,
            per_rank,
        )
    kinds = {kind for _, kind, _ in rows}
    if kinds == {_EXPLICIT}:
        if len(set(seeds)) == 1:
            return rows[0][0]
        raise SeedMismatchError(
            "the ranks passed different seeds: "
            + grouped([f"seed={seed}" for seed in seeds])
            + ". Pass the same seed on every rank (it must not depend on the rank or the "
            "node's environment), or seed=None on every rank to let the source rank draw one.",
            seeds,
            per_rank,
        )
    if _EXPLICIT in kinds:
        raise SeedMismatchError(
            "some ranks passed seed=None and others an explicit seed: "
            + grouped([f"seed={seed}" for seed in seeds])
            + ". Pass the same seed on every rank, or seed=None on every rank.",
            seeds,
            per_rank,
        )
    if rows[src_rank][1] == _UNRESOLVED:
        raise ValueError(
            f"rank {src_rank} (the source rank) could not read a seed: its ${SEED_ENV} is not "
            f"a valid seed. Set it to an integer in [0, 2**32 - 1] or unset it."
        )
    return rows[src_rank][0]


def grouped(labels: Sequence[str]) -> str:
    """``"seed=1 on ranks 0-2, 4; seed=2 on rank 3"`` from one label per rank."""
    ranks_of = ranks_by_label(dict(enumerate(labels)))
    return "; ".join(f"{label} on {ranks_text(ranks)}" for label, ranks in ranks_of.items())
