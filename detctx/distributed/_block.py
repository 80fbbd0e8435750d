"""``distributed_deterministic``: a ``deterministic`` block whose seed every rank agreed on.

It is a ``deterministic`` block with another coordinator
(:class:`RankCoordinator`): on each entry the ranks agree on the seed
(:mod:`detctx.distributed._agreement`), then the block is entered, exited and
interrupted exactly as a ``deterministic`` block; ``verify=True`` adds
:mod:`detctx.distributed._rank_check` on entry and exit. Every entry is a
collective: every rank of the group must enter the same blocks in the same
order. Outside a process group nothing is
communicated and the block is a ``deterministic`` block of a single rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from typing_extensions import Unpack

from detctx._basics import note_entry
from detctx._blocks import Seeding, Settings, deterministic
from detctx._blocks import stack as blocks
from detctx._switches import SwitchOptions
from detctx.distributed._agreement import (
    Agreement,
    DistributedSeeding,
    MegatronSeeds,
    agree,
    check_arguments,
    check_megatron_seeds,
)
from detctx.distributed._arrival import DEFAULT_TIMEOUT_S, check_timeout, timed_out
from detctx.distributed._mesh import MeshSeeds, TrackerEntry, check_mesh_seeds
from detctx.distributed._rank_check import verify_across_ranks, verify_on_exit
from detctx.distributed._topology import warn_superpod

__all__ = ["RankCoordinator", "distributed_deterministic"]


@dataclass(frozen=True)
class _Agreed:
    """One entry's agreement: this rank's seed, and the record it makes."""

    agreement: Agreement
    coordinator: RankCoordinator

    @property
    def seed(self) -> int:
        return self.agreement.seed

    def record(self, seeding: Seeding) -> DistributedSeeding:
        agreement, options = self.agreement, self.coordinator
        return DistributedSeeding(
            seeding.seed,
            seeding.sources,
            seeding.switches,
            agreement.shared_seed,
            agreement.rank,
            agreement.world_size,
            options.per_rank,
            options.group,
            options.megatron_seeds,
            options.mesh_seeds,
        )


class RankCoordinator:
    """Each entry's seed agreed across the ranks of ``group``; ``verify``: checked on
    entry and exit (:mod:`detctx.distributed._rank_check`). Arguments are checked here."""

    __slots__ = (
        "group",
        "megatron_seeds",
        "mesh_seeds",
        "per_rank",
        "src",
        "timeout",
        "trackers",
        "verify",
    )

    def __init__(
        self,
        *,
        per_rank: bool,
        group: Any,
        src: int,
        verify: bool,
        timeout: float,
        megatron_seeds: MegatronSeeds | None,
        mesh: Any = None,
        distinct_dims: object = (),
    ) -> None:
        check_arguments(None, per_rank, group, src)
        self.megatron_seeds = check_megatron_seeds(megatron_seeds, per_rank)
        self.mesh_seeds = check_mesh_seeds(
            mesh, distinct_dims, per_rank=per_rank, megatron_seeds=megatron_seeds
        )
        # Each open entry's DTensor tracker, put back when that entry exits.
        self.trackers: dict[object, TrackerEntry] = {}
        if not isinstance(verify, bool):
            raise TypeError(f"verify must be True or False, got {verify!r}")
        self.per_rank = per_rank
        self.group = group
        self.src = src
        self.verify = verify
        self.timeout = check_timeout(timeout)

    def begin(self, settings: Settings) -> _Agreed:
        """Agree with the other ranks on this entry's seed (a collective)."""
        if settings.switches["hccl"] is not False:
            warn_superpod()
        agreement = agree(
            settings.seed,
            self.per_rank,
            self.group,
            self.src,
            self.timeout,
            self.mesh_seeds if self.megatron_seeds is None else self.megatron_seeds,
        )
        # For detctx run, before seeding, as a one-process block notes its seed.
        note_entry(
            agreement.shared_seed,
            given=settings.seed is not None,
            block="distributed_deterministic",
        )
        return _Agreed(agreement, self)

    def after_entry(self) -> None:
        entry = blocks.entered_here()[-1]
        if self.mesh_seeds is not None:
            self.trackers[entry] = TrackerEntry(self.mesh_seeds.mesh, entry.seeding.seed)
        try:
            if self.verify:
                verify_across_ranks(self.group, timeout=self.timeout)
        except BaseException:
            self._put_back_tracker(entry)  # the block is abandoned, without before_exit
            raise

    def _put_back_tracker(self, entry: object) -> None:
        tracker = self.trackers.pop(entry, None)
        if tracker is not None:
            tracker.restore()

    def before_exit(self, owner: object, raised: BaseException | None) -> None:
        # Only an exit of a block this context entered checks: a stray exit is an error
        # of its own (OutOfOrderExitError), not a collective.
        mine = [block for block in blocks.entered_here() if block.owner is owner]
        if mine:
            self._put_back_tracker(mine[-1])
        if not self.verify or not mine:
            return
        if timed_out(raised):
            # A collective of this rank timed out inside the block: the job is going down,
            # and waiting here for the others again would double the documented bound.
            return
        try:
            verify_on_exit(self.group, self.timeout, raised)
        except Exception:
            if raised is None:
                raise
            # This rank raised in the body: that exception is the one to see.

    def options(self) -> dict[str, object]:
        return {
            name: value
            for name, value, default in (
                ("per_rank", self.per_rank, False),
                ("group", self.group, None),
                ("src", self.src, 0),
                ("verify", self.verify, False),
                ("timeout", self.timeout, DEFAULT_TIMEOUT_S),
                ("megatron_seeds", self.megatron_seeds, None),
                ("mesh", None if self.mesh_seeds is None else self.mesh_seeds.mesh, None),
                (
                    "distinct_dims",
                    () if self.mesh_seeds is None else self.mesh_seeds.distinct_dims,
                    (),
                ),
            )
            if value != default
        }


class distributed_deterministic(deterministic):
    """``deterministic`` for every rank of a ``torch.distributed`` process group.

    On each entry the ranks agree on one seed in a single ``all_gather`` of
    three integers per rank (see :func:`agree_seed`): with ``seed=None`` (the
    default) the source rank ``src`` reads ``$DETCTX_SEED`` or draws a fresh
    seed and every rank uses it; with an explicit seed, every rank checks that
    all passed the same one and, if not, every rank raises the same
    :class:`~detctx.SeedMismatchError` listing each rank's seed, before
    anything is changed. Then the block is a :class:`deterministic` block with
    the agreed seed: everything is saved, seeded, switched on and, on exit,
    restored, exactly as there.

    ``per_rank=False``: every rank is seeded with the shared seed and draws
    the same numbers. ``per_rank=True``: rank ``r`` (of ``group``) is seeded
    with ``derive_seed(shared_seed, r)``, a distinct stream per rank that
    repeats on every rerun with the same seed and world size (dropout masks
    that differ per data-parallel rank, say). Parallel layouts can derive
    further streams with :meth:`DistributedRun.group_seed`.
    ``megatron_seeds=MegatronSeeds(pp_rank=..., dp_rank=...)``: rank seeds as
    Megatron's ``_set_random_seed`` derives them (``seed + 100 * pp_rank``,
    plus ``10 * dp_rank`` if given), so a Megatron or MindSpeed-LLM run gets
    the numbers it got from ``--seed`` (see ``docs/megatron.md``).
    ``mesh=device_mesh, distinct_dims=("pp",)``: rank seeds as torchtitan's
    ``set_determinism`` derives them, ``seed + sum(local_rank(d_i) *
    prod(size(d_j), j < i))`` over the named dims in order, so ranks that
    differ only in the other dims (an SPMD group) draw the same streams;
    DTensor's RNG tracker is seeded on entry (where torch has one for the
    mesh's devices) and the previous one put back on exit. Not with
    ``per_rank`` or ``megatron_seeds``; a mesh this rank is not in raises
    ``ValueError`` here (see ``docs/mesh.md``).

    ``verify=True`` runs :func:`verify_across_ranks` after seeding on entry and
    before restoring on exit. Every rank takes part in the exit check whatever
    happened in the body: if a rank raised, it goes on with its own exception
    and the others raise :class:`~detctx.SeedAgreementError` saying
    "rank 1 raised ValueError inside the block" rather than reporting a
    divergence.

    ``timeout`` (seconds, default 300) bounds each of these collectives: a
    rank that waits longer for the others (one never entered the block,
    crashed, or is stuck in another collective) raises
    :class:`~detctx.SeedAgreementError` naming the ranks that did not
    arrive, after up to twice ``timeout`` (the second half spent learning who
    is missing), instead of hanging until the process group's timeout. That
    bound holds for nested blocks too: while such an error propagates, the
    exit checks of the enclosing blocks are skipped, and any later collective
    of detctx on that group raises at once (the group is unusable)::

        with detctx.distributed_deterministic(seed=1234, timeout=60.0):
            train()

    The switches are those of :class:`deterministic`. ``HCCL_DETERMINISTIC``
    is read by torch_npu when the first HCCL communicator is configured, so
    inside a block on an HCCL group it comes too late: a
    :class:`~detctx.DeterminismWarning` names it and says to export it
    before launch (or call :func:`prepare_environment` in the launcher). A
    warning is also given when ``HCCL_LOGIC_SUPERPOD_ID`` is set.

    Every rank of the group must enter the same blocks in the same order, as
    with any collective. Outside a process group (a plain ``python train.py``)
    nothing is communicated and the block behaves like
    ``deterministic(seed, ...)``, the process being rank 0 of 1 (so
    ``per_rank=True`` seeds ``derive_seed(seed, 0)``, as a one-process
    ``torchrun`` launch would). Entering returns a
    :class:`~detctx.distributed._agreement.DistributedSeeding`.
    """

    def __init__(
        self,
        seed: int | None = None,
        *,
        per_rank: bool = False,
        group: Any = None,
        src: int = 0,
        verify: bool = False,
        timeout: float = DEFAULT_TIMEOUT_S,
        megatron_seeds: MegatronSeeds | None = None,
        mesh: Any = None,
        distinct_dims: Sequence[str] = (),
        **switches: Unpack[SwitchOptions],
    ) -> None:
        self._ranks = RankCoordinator(
            per_rank=per_rank,
            group=group,
            src=src,
            verify=verify,
            timeout=timeout,
            megatron_seeds=megatron_seeds,
            mesh=mesh,
            distinct_dims=distinct_dims,
        )
        super().__init__(seed, **switches)

    def _coordinator(self) -> RankCoordinator:
        return self._ranks

    @property
    def per_rank(self) -> bool:
        """Whether each rank is seeded with its own derived seed."""
        return self._ranks.per_rank

    @property
    def group(self) -> Any:
        """The process group the ranks agree over (``None``: the default group)."""
        return self._ranks.group

    @property
    def src(self) -> int:
        """The global rank that draws the seed when ``seed=None``."""
        return self._ranks.src

    @property
    def verify(self) -> bool:
        """Whether the ranks' states are compared on entry and exit."""
        return self._ranks.verify

    @property
    def mesh_seeds(self) -> MeshSeeds | None:
        """Where this rank stands along the mesh's distinct dims (``None``: no ``mesh=``)."""
        return self._ranks.mesh_seeds

    @property
    def timeout(self) -> float:
        """Seconds each rank waits for the others in the block's collectives."""
        return self._ranks.timeout

    if TYPE_CHECKING:
        # The entry is deterministic.__enter__ itself (no frame of ours between it and
        # the `with`, where a Ctrl-C could leave the block open); its record is a
        # DistributedSeeding, made by the coordinator.
        def __enter__(self) -> DistributedSeeding: ...
