"""Seed agreement: every rank of a group learns every rank's seed in one ``all_gather``.

Each rank sends ``[seed, kind, derivation]``: so ranks that passed different
seeds (or mixed ``None`` and explicit seeds, or derive their own seeds
differently: ``per_rank``, ``megatron_seeds``) all raise the same
:class:`~detctx.SeedMismatchError` after the same collective, and none is
left waiting for a rank that already gave up. Each rank then derives its own
seed from the agreed one: the same seed, ``derive_seed(seed, rank)``, or
Megatron's offsets (:class:`MegatronSeeds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from detctx._basics import (
    SEED_ENV,
    SeedMismatchError,
    as_integer,
    derive_seed,
    group_seed,
    megatron_stage_seed,
    resolve_seed,
    validate_seed,
)
from detctx._blocks import Seeding
from detctx.distributed._arrival import (
    DEFAULT_TIMEOUT_S,
    check_timeout,
    gather_rows,
    ranks_by_label,
    ranks_text,
)
from detctx.distributed._mesh import MeshSeeds
from detctx.distributed._topology import in_process_group, rank_and_size

__all__ = [
    "Agreement",
    "DistributedSeeding",
    "MegatronSeeds",
    "agree",
    "agree_seed",
    "check_arguments",
    "check_megatron_seeds",
    "decide",
    "grouped",
]

_EXPLICIT, _DRAWN, _UNRESOLVED = 1, 0, -1
# How a rank's seed comes from the agreed one: the third column of an agreement row.
_SHARED, _PER_RANK, _MEGATRON_PP, _MEGATRON_PP_DP, _MESH = 0, 1, 2, 3, 4
# A mesh's code also carries a fingerprint of the mesh and its distinct dims, in the bits
# above these: ranks that disagree on either would draw from unrelated seeds.
_CODE_BITS = 3
_DERIVATION_TEXT = {
    _SHARED: "per_rank=False",
    _PER_RANK: "per_rank=True",
    _MEGATRON_PP: "megatron_seeds (pipeline offsets)",
    _MEGATRON_PP_DP: "megatron_seeds (pipeline and data-parallel offsets)",
}


@dataclass(frozen=True)
class MegatronSeeds:
    """This rank's seed derived from the agreed one as Megatron's ``_set_random_seed`` does.

    ``seed + 100 * pp_rank``, plus ``10 * dp_rank`` when ``dp_rank`` is given
    (Megatron's ``--data-parallel-random-init``); taken modulo ``2**32`` where
    it would pass NumPy's limit (Megatron itself fails there). Pass it to
    :class:`distributed_deterministic` so that ``random``, NumPy, torch and
    the devices get the numbers Megatron (and MindSpeed-LLM's
    ``--npu-deterministic``) gives each pipeline stage::

        stage = MegatronSeeds(pp_rank=parallel_state.get_pipeline_model_parallel_rank())
        with detctx.distributed_deterministic(seed=1234, megatron_seeds=stage):
            train()

    Megatron's offsets collide (``pp_rank=1`` and ``dp_rank=10`` give one
    seed); :func:`~detctx.group_seed` does not, for layouts that need not
    match Megatron's numbers. ``pp_rank`` and ``dp_rank`` are integers in
    ``[0, 2**32 - 1]``; anything else raises here.
    """

    pp_rank: int
    dp_rank: int | None = None

    def __post_init__(self) -> None:
        # Frozen: a NumPy integer is stored as the int it stands for.
        object.__setattr__(self, "pp_rank", validate_seed(self.pp_rank, "pp_rank"))
        if self.dp_rank is not None:
            object.__setattr__(self, "dp_rank", validate_seed(self.dp_rank, "dp_rank"))

    def seed_for(self, seed: int) -> int:
        """This rank's seed when the ranks agreed on ``seed``."""
        return megatron_stage_seed(seed, self.pp_rank, self.dp_rank)


RankSeeds = MegatronSeeds | MeshSeeds
"""How each rank's seed comes from the agreed one, beyond ``per_rank``."""


def _derivation(per_rank: bool, own: RankSeeds | None) -> int:
    """The derivation code a rank sends in its agreement row."""
    if isinstance(own, MeshSeeds):
        return _MESH | own.fingerprint() << _CODE_BITS
    if own is not None:
        return _MEGATRON_PP if own.dp_rank is None else _MEGATRON_PP_DP
    return _PER_RANK if per_rank else _SHARED


def _derivation_text(how: int) -> str:
    if how & ((1 << _CODE_BITS) - 1) == _MESH:
        return f"mesh= with distinct_dims (mesh and dims #{how >> _CODE_BITS:x})"
    return _DERIVATION_TEXT.get(how, f"derivation {how}")


def check_megatron_seeds(megatron_seeds: object, per_rank: object) -> MegatronSeeds | None:
    """``megatron_seeds`` checked: a :class:`MegatronSeeds` or ``None``, not with ``per_rank``."""
    if megatron_seeds is None:
        return None
    if not isinstance(megatron_seeds, MegatronSeeds):
        raise TypeError(
            f"megatron_seeds must be a detctx.distributed.MegatronSeeds or None, got "
            f"{type(megatron_seeds).__name__}"
        )
    if per_rank is True:
        raise ValueError(
            "per_rank=True and megatron_seeds both derive each rank's seed: pass one of them"
        )
    return megatron_seeds


@dataclass(frozen=True)
class DistributedSeeding(Seeding):
    """What one entry of :class:`distributed_deterministic` applied on this rank.

    ``seed`` is the seed this rank's RNGs were seeded with: ``shared_seed``
    itself, or with ``per_rank=True`` ``derive_seed(shared_seed, rank)``.
    ``shared_seed`` is the seed all ranks agreed on; rerun with
    ``distributed_deterministic(seed=seeding.shared_seed, ...)`` on the same world
    size to repeat the run. ``rank`` and ``world_size`` are within the block's
    group (0 and 1 outside a process group); ``group`` is that process group
    (``None``: the default group). ``megatron_seeds``: the
    :class:`MegatronSeeds` this rank's seed was derived with, if any;
    ``mesh_seeds``: likewise the ``DeviceMesh`` derivation (``mesh=``,
    ``distinct_dims=``), whose ``distinct_dims``, ``local_ranks`` and
    ``sizes`` say where this rank stands.
    """

    shared_seed: int
    rank: int
    world_size: int
    per_rank: bool
    group: Any = field(default=None, repr=False, compare=False)
    megatron_seeds: MegatronSeeds | None = None
    mesh_seeds: MeshSeeds | None = None

    def group_seed(self, **coordinates: int) -> int:
        """:func:`~detctx.group_seed` of the shared seed, e.g. ``run.group_seed(tp=0)``."""
        return group_seed(self.shared_seed, **coordinates)

    def describe(self) -> str:
        stream = "per-rank stream" if self.per_rank else "same stream on every rank"
        if self.megatron_seeds is not None:
            stream = f"Megatron's offsets ({self.megatron_seeds})"
        if self.mesh_seeds is not None:
            stream = f"distinct along {self.mesh_seeds.distinct_dims} of the mesh"
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
    seed: int | None,
    per_rank: bool,
    group: Any,
    src: int,
    timeout: float = DEFAULT_TIMEOUT_S,
    megatron_seeds: RankSeeds | None = None,
) -> Agreement:
    """Agree with the other ranks on the seed of one entry (arguments already checked)."""
    if not in_process_group():
        shared = resolve_seed(seed)
        return Agreement(_own_seed(shared, 0, per_rank, megatron_seeds), shared, 0, 1)
    rank, world_size = rank_and_size(group)
    src_rank = _group_rank(group, int(src))  # a NumPy integer too (check_arguments)
    failure: ValueError | None = None
    how = _derivation(per_rank, megatron_seeds)
    if seed is not None:
        row = [seed, _EXPLICIT, how]
    elif rank == src_rank:
        try:
            row = [resolve_seed(None), _DRAWN, how]
        except ValueError as exc:
            # Raising here alone would leave every other rank waiting in the gather.
            failure = exc
            row = [-1, _UNRESOLVED, how]
    else:
        row = [-1, _DRAWN, how]
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
    return Agreement(_own_seed(shared, rank, per_rank, megatron_seeds), shared, rank, world_size)


def _own_seed(shared: int, rank: int, per_rank: bool, own: RankSeeds | None) -> int:
    if own is not None:
        return own.seed_for(shared)
    return derive_seed(shared, rank) if per_rank else shared


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
    """The agreed seed from every rank's ``[seed, kind, derivation]`` row, or the same error."""
    seeds = tuple(None if kind != _EXPLICIT else value for value, kind, _ in rows)
    derivations = tuple(how for _, _, how in rows)
    per_rank = tuple(how == _PER_RANK for how in derivations)
    if len(set(derivations)) > 1:
        raise SeedMismatchError(
            "the ranks disagree on how each rank's seed is derived: "
            + grouped([_derivation_text(how) for how in derivations])
            + ". Pass the same per_rank, megatron_seeds (each with or without dp_rank) and "
            "mesh with distinct_dims on every rank.",
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
