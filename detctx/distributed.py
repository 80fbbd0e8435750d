"""``distributed_deterministic``: one agreed seed on every rank of a ``torch.distributed`` group.

The distributed variant adds three things to :class:`~detctx.context.deterministic`,
all carried by the process group the program already uses (HCCL, NCCL, gloo):

- agreement: one ``all_gather`` of a 3-integer row per rank on each entry, so
  every rank knows every rank's seed, raises the same error when they differ,
  and never waits on a rank that already gave up;
- per-rank streams derived from the shared seed through NumPy's
  ``SeedSequence`` (:func:`~detctx.seeds.derive_seed`), never ``seed + rank``;
- verification: one ``all_gather`` of per-source fingerprints.

Every entry is a collective: every rank of the group must enter the same
blocks in the same order, as with any other collective. Outside a process
group nothing is communicated and a block is an ordinary ``deterministic``
block of a single rank 0.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Literal

import torch

from detctx.accelerators import AcceleratorSource, _device_module
from detctx.context import Run, deterministic
from detctx.errors import (
    DeterminismWarning,
    OutOfOrderExitError,
    RankDivergenceError,
    SeedMismatchError,
)
from detctx.seeds import SEED_ENV, derive_seed, resolve_seed, validate_seed
from detctx.sources import RNGSource
from detctx.state import RNGState, active_sources
from detctx.switches import env_switches

__all__ = [
    "SUPERPOD_ENV",
    "DistributedRun",
    "agree_seed",
    "collective_device",
    "distributed_deterministic",
    "group_seed",
    "prepare_environment",
    "verify_across_ranks",
]

logger = logging.getLogger("detctx")

SUPERPOD_ENV: Final = "HCCL_LOGIC_SUPERPOD_ID"
"""Set on Ascend clusters whose HCCL collectives cross superpods over RoCE."""

# Backends whose collectives take CPU tensors, and the accelerator backends
# known even where torch.distributed.Backend does not list them (HCCL is
# registered by torch_npu, XCCL only by torch >= 2.7).
_CPU_BACKENDS: Final = frozenset({"gloo", "mpi"})
_ACCELERATOR_BACKENDS: Final = {"nccl": "cuda", "hccl": "npu", "xccl": "xpu"}

# Fingerprint slots in a verification row; sources beyond the last slot are
# folded into it, which keeps the row the same size on every rank.
_SLOTS: Final = 32
_OUTSIDE, _SHARED, _PER_RANK = 0, 1, 2
_EXPLICIT, _DRAWN, _UNRESOLVED = 1, 0, -1


@dataclass(frozen=True)
class DistributedRun(Run):
    """What one entry of :class:`distributed_deterministic` applied on this rank.

    ``seed`` is the seed this rank's RNGs were seeded with: ``shared_seed``
    itself, or with ``per_rank=True`` ``derive_seed(shared_seed, rank)``.
    ``shared_seed`` is the seed all ranks agreed on; rerun with
    ``distributed_deterministic(seed=run.shared_seed, ...)`` on the same world
    size to repeat the run. ``rank`` and ``world_size`` are within the block's
    group (0 and 1 outside a process group).
    """

    shared_seed: int
    rank: int
    world_size: int
    per_rank: bool

    def group_seed(self, **coordinates: int) -> int:
        """:func:`group_seed` of the shared seed, e.g. ``run.group_seed(tp=tp_rank)``."""
        return group_seed(self.shared_seed, **coordinates)

    def describe(self) -> str:
        stream = "per-rank stream" if self.per_rank else "same stream on every rank"
        return (
            f"{super().describe()}; rank {self.rank} of {self.world_size}, "
            f"shared seed {self.shared_seed}, {stream}"
        )


def group_seed(seed: int, **coordinates: int) -> int:
    """A seed for the stream of one position in a parallel layout.

    ``group_seed(s, tp=tp_rank)`` gives every tensor-parallel rank its own
    stream, shared by the data-parallel replicas of that rank;
    ``group_seed(s, pp=pp_rank, tp=tp_rank, dp=dp_rank)`` one per rank. The
    coordinates' names and values are hashed together with ``seed`` through
    NumPy's ``SeedSequence`` (:func:`~detctx.seeds.derive_seed`), in name
    order, so the result does not depend on argument order, and, unlike
    Megatron's ``seed + 100 * pp_rank + 10 * dp_rank`` offsets, different
    layouts and positions do not collide in practice. Values are integers in
    ``[0, 2**32 - 1]``.
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


def collective_device(backend: str) -> torch.device:
    """The device a collective of ``backend`` needs its tensors on.

    CPU for gloo and MPI, and for mixed backends that include a CPU one
    (``"cpu:gloo,cuda:nccl"``); otherwise the *current* device of the
    backend's accelerator (``nccl`` -> CUDA, ``hccl`` -> NPU, ``xccl`` -> XPU,
    or whatever ``torch.distributed.Backend`` maps to it). Looking up the
    current device initialises the accelerator, which the backend has done
    already.
    """
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"backend must be a non-empty string, got {backend!r}")
    name = backend.lower()
    if ":" in name:
        pairs = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        if "cpu" in pairs:
            return torch.device("cpu")
        device_type = next(iter(pairs))
    elif name in _CPU_BACKENDS:
        return torch.device("cpu")
    else:
        device_type = _backend_device_type(name)
    if device_type == "cpu":
        return torch.device("cpu")
    module = _device_module(device_type)
    is_available = getattr(module, "is_available", None)
    if module is None or is_available is None or not is_available():
        raise RuntimeError(
            f"the {backend!r} backend needs {device_type!r} devices, and none is available in "
            f"this process; create the process group with a backend for the devices present "
            f"(gloo on CPU)"
        )
    return torch.device(device_type, int(module.current_device()))


def _backend_device_type(backend: str) -> str:
    dist = torch.distributed
    known = getattr(getattr(dist, "Backend", None), "default_device_backend_map", None) or {}
    for device_type, name in known.items():
        if name == backend and name not in _CPU_BACKENDS:
            return str(device_type)
    if backend in _ACCELERATOR_BACKENDS:
        return _ACCELERATOR_BACKENDS[backend]
    raise ValueError(
        f"unknown torch.distributed backend {backend!r}: detctx does not know which device its "
        f"collectives need; use gloo, nccl, hccl or xccl, or a mixed backend such as "
        f"'cpu:gloo,cuda:nccl'"
    )


def _in_process_group() -> bool:
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def _rank_and_size(group: Any) -> tuple[int, int]:
    dist = torch.distributed
    rank = int(dist.get_rank(group))
    if rank < 0:
        raise ValueError(
            "this process is not a member of the given process group; enter the block "
            "(or call verify_across_ranks) only on the group's ranks"
        )
    return rank, int(dist.get_world_size(group))


def _all_gather_rows(row: Sequence[int], group: Any, world_size: int) -> list[list[int]]:
    """Every rank's ``row`` (one int64 tensor each), in group-rank order."""
    dist = torch.distributed
    device = collective_device(str(dist.get_backend(group)))
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    rows: list[list[int]] = torch.stack(gathered).cpu().tolist()
    return rows


# ---------------------------------------------------------------------------
# Agreement


def agree_seed(
    seed: int | None = None,
    *,
    group: Any = None,
    src: int = 0,
    per_rank: bool = False,
) -> int:
    """The seed every rank of ``group`` agrees on, in one ``all_gather``.

    With ``seed=None`` the source rank ``src`` (a global rank, as in
    ``torch.distributed.broadcast``) reads ``$DETCTX_SEED`` or draws a fresh
    seed, and every rank gets it. With an explicit seed every rank checks that
    all ranks passed the same one (and the same ``per_rank``); if not, every
    rank raises the same :class:`~detctx.errors.SeedMismatchError`. Nothing is
    seeded. Outside a process group, returns the resolved seed.

    This is the agreement step of :class:`distributed_deterministic` alone.
    """
    checked = _check_arguments(seed, per_rank, group, src)
    return _agree(checked, per_rank, group, src)[0]


def _check_arguments(seed: object, per_rank: object, group: object, src: object) -> int | None:
    checked = None if seed is None else validate_seed(seed)
    if not isinstance(per_rank, bool):
        raise TypeError(f"per_rank must be True or False, got {per_rank!r}")
    if isinstance(src, bool) or not isinstance(src, int):
        raise TypeError(f"src must be a global rank (an int), got {src!r}")
    if src < 0:
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


def _agree(seed: int | None, per_rank: bool, group: Any, src: int) -> tuple[int, int, int]:
    """``(shared_seed, rank, world_size)`` for one entry."""
    if not _in_process_group():
        return resolve_seed(seed), 0, 1
    rank, world_size = _rank_and_size(group)
    src_rank = _group_rank(group, src)
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
    rows = [row] if world_size == 1 else _all_gather_rows(row, group, world_size)
    try:
        shared = _decide(rows, src_rank)
    except ValueError as exc:
        if failure is not None:
            raise exc from failure
        raise
    return shared, rank, world_size


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


def _decide(rows: list[list[int]], src_rank: int) -> int:
    """The agreed seed from every rank's ``[seed, kind, per_rank]`` row, or the same error."""
    seeds = tuple(None if kind != _EXPLICIT else value for value, kind, _ in rows)
    per_rank = tuple(bool(flag) for _, _, flag in rows)
    if len(set(per_rank)) > 1:
        raise SeedMismatchError(
            "the ranks disagree on per_rank: "
            + _grouped([f"per_rank={flag}" for flag in per_rank])
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
            + _grouped([f"seed={seed}" for seed in seeds])
            + ". Pass the same seed on every rank (it must not depend on the rank or the "
            "node's environment), or seed=None on every rank to let the source rank draw one.",
            seeds,
            per_rank,
        )
    if _EXPLICIT in kinds:
        raise SeedMismatchError(
            "some ranks passed seed=None and others an explicit seed: "
            + _grouped([f"seed={seed}" for seed in seeds])
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


def _grouped(labels: Sequence[str]) -> str:
    """``"seed=1 on ranks 0-2, 4; seed=2 on rank 3"`` from one label per rank."""
    ranks_of: dict[str, list[int]] = {}
    for rank, label in enumerate(labels):
        ranks_of.setdefault(label, []).append(rank)
    return "; ".join(f"{label} on {_ranks_text(ranks)}" for label, ranks in ranks_of.items())


def _ranks_text(ranks: Sequence[int]) -> str:
    """``"ranks 0-3, 7"``: consecutive ranks as ranges, so a thousand ranks stay readable."""
    spans: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


# ---------------------------------------------------------------------------
# Verification


def verify_across_ranks(group: Any = None) -> None:
    """Check, in one small ``all_gather``, that the ranks' RNG states agree.

    Each rank sends, for every managed RNG source, an 8-byte fingerprint of
    its state (for an accelerator: the state of this rank's current device,
    the one it draws from), plus the agreed seed and a fingerprint of the set
    of source names. Every rank then raises the same
    :class:`~detctx.errors.RankDivergenceError`, naming the ranks and the
    sources that differ from the majority (on a tie, from the lowest rank's).

    Inside a ``per_rank=True`` block the states differ by design, so they are
    not compared; what must agree is what was derived from the shared seed:
    the shared seed itself, each rank's seed being
    ``derive_seed(shared_seed, rank)``, and the set of managed sources. (A rank
    that drew extra numbers from its own per-rank stream cannot be told from
    the others; compare runs with :func:`detctx.fingerprint` for that.)

    ``group`` defaults to the group of the innermost enclosing
    :class:`distributed_deterministic` block, else the default group. Every
    rank of the group must call it. Outside a process group, or in a group of
    one, there is nothing to compare and it returns at once. Nothing is changed.
    """
    frames = _open.get()
    frame = frames[-1] if frames else None
    if group is None and frame is not None:
        group = frame.group
    _check_arguments(None, False, group, 0)
    if not _in_process_group():
        return
    _, world_size = _rank_and_size(group)
    if world_size == 1:
        return
    sources = sorted(active_sources(), key=lambda item: item[0])
    names = [name for name, _ in sources]
    row = _verification_row(frame.run if frame is not None else None, sources)
    divergent = _compare(_all_gather_rows(row, group, world_size), row, names)
    if divergent:
        raise RankDivergenceError(_divergence_message(divergent, world_size), divergent)


def _verification_row(
    run: DistributedRun | None, sources: list[tuple[str, RNGSource]]
) -> list[int]:
    """``[mode, shared seed, seed, rank, names fingerprint, count, slot, ...]``."""
    names_key = _int64(hashlib.blake2b("\0".join(n for n, _ in sources).encode(), digest_size=8))
    slots = [0] * _SLOTS
    if run is None:
        header = [_OUTSIDE, -1, -1, -1]
    elif run.per_rank:
        header = [_PER_RANK, run.shared_seed, run.seed, run.rank]
    else:
        header = [_SHARED, run.shared_seed, run.seed, run.rank]
    if run is None or not run.per_rank:
        states = RNGState.capture(sources)
        overflow = hashlib.blake2b(digest_size=8)
        for index, (name, source) in enumerate(sources):
            fingerprint = _source_fingerprint(name, source, states[name])
            if index < _SLOTS - 1 or len(sources) == _SLOTS:
                slots[index] = fingerprint
            else:
                overflow.update(fingerprint.to_bytes(8, "little", signed=True))
                slots[_SLOTS - 1] = _int64(overflow)
    return [*header, names_key, len(sources), *slots]


def _source_fingerprint(name: str, source: RNGSource, state: Any) -> int:
    if isinstance(source, AcceleratorSource) and isinstance(state, tuple) and len(state) > 1:
        # Each rank seeds every visible device but draws from its own: compare that one only.
        state = (state[int(source.module.current_device())],)
    digest = RNGState([(name, source)], [state]).fingerprint()
    return int.from_bytes(bytes.fromhex(digest), "little", signed=True)


def _int64(digest: Any) -> int:
    return int.from_bytes(digest.digest(), "little", signed=True)


def _reference(values: Sequence[int]) -> int:
    """The most common value; on a tie, the one the lowest rank holds."""
    counts = Counter(values)
    most = max(counts.values())
    return next(value for value in values if counts[value] == most)


def _compare(
    rows: list[list[int]], mine: list[int], names: list[str]
) -> dict[int, tuple[str, ...]]:
    """Which ranks differ from the majority, and in what (the same answer on every rank)."""
    found: dict[int, list[str]] = {}
    modes = [row[0] for row in rows]
    mode = _reference(modes)
    for rank, other in enumerate(modes):
        if other != mode:
            found.setdefault(rank, []).append("block")
    peers = [rank for rank in range(len(rows)) if modes[rank] == mode]
    if mode != _OUTSIDE:
        shared = _reference([rows[rank][1] for rank in peers])
        for rank in peers:
            if rows[rank][1] != shared:
                found.setdefault(rank, []).append("seed")
    if mode == _PER_RANK:
        for rank in peers:
            if rows[rank][2] != derive_seed(rows[rank][1], rows[rank][3]):
                found.setdefault(rank, []).append("derivation")
    names_key = _reference([rows[rank][4] for rank in peers])
    same = [rank for rank in peers if rows[rank][4] == names_key]
    for rank in peers:
        if rows[rank][4] != names_key:
            found.setdefault(rank, []).append("sources")
    if mode != _PER_RANK:
        count = rows[same[0]][5]
        for slot in range(min(count, _SLOTS)):
            reference = _reference([rows[rank][6 + slot] for rank in same])
            label = _slot_label(slot, count, names if mine[4] == names_key else None)
            for rank in same:
                if rows[rank][6 + slot] != reference:
                    found.setdefault(rank, []).append(label)
    return {rank: tuple(found[rank]) for rank in sorted(found)}


def _slot_label(slot: int, count: int, names: list[str] | None) -> str:
    if names is None:
        # This rank manages other sources than the majority, so it cannot name theirs.
        return f"source #{slot}"
    if slot == _SLOTS - 1 and count > _SLOTS:
        return f"{names[slot]} (or one of the {count - _SLOTS} sources after it)"
    return names[slot]


def _divergence_message(divergent: dict[int, tuple[str, ...]], world_size: int) -> str:
    what = _grouped_ranks({rank: ", ".join(items) for rank, items in divergent.items()})
    return (
        f"RNG states differ across the {world_size} ranks of the group, compared with the "
        f"majority: {what}. A rank drew random numbers the others did not (a rank-dependent "
        f"branch, an evaluation or logging step on one rank, a different number of batches), "
        f"or entered its block differently. Give rank-dependent work its own generator "
        f"(detctx.register_source) or block, or use per_rank=True where streams should differ."
    )


def _grouped_ranks(labels: dict[int, str]) -> str:
    ranks_of: dict[str, list[int]] = {}
    for rank, label in labels.items():
        ranks_of.setdefault(label, []).append(rank)
    return "; ".join(f"{_ranks_text(ranks)}: {label}" for label, ranks in ranks_of.items())


# ---------------------------------------------------------------------------
# The block


@dataclass(frozen=True)
class _DistFrame:
    owner: distributed_deterministic
    inner: deterministic
    run: DistributedRun
    group: Any


# The distributed blocks entered in this context (thread or asyncio task), innermost last.
_open: contextvars.ContextVar[tuple[_DistFrame, ...]] = contextvars.ContextVar(
    "detctx_distributed_open", default=()
)


class distributed_deterministic(deterministic):
    """``deterministic`` for every rank of a ``torch.distributed`` process group.

    On each entry the ranks agree on one seed in a single ``all_gather`` of
    three integers per rank (see :func:`agree_seed`): with ``seed=None`` (the
    default) the source rank ``src`` reads ``$DETCTX_SEED`` or draws a fresh
    seed and every rank uses it; with an explicit seed, every rank checks that
    all passed the same one and, if not, every rank raises the same
    :class:`~detctx.errors.SeedMismatchError` listing each rank's seed, before
    anything is changed. Then the block is a :class:`deterministic` block with
    the agreed seed: everything is saved, seeded, switched on and, on exit,
    restored, exactly as there.

    ``per_rank=False``: every rank is seeded with the shared seed and draws
    the same numbers. ``per_rank=True``: rank ``r`` (of ``group``) is seeded
    with ``derive_seed(shared_seed, r)``, a distinct stream per rank that
    repeats on every rerun with the same seed and world size (dropout masks
    that differ per data-parallel rank, say). Parallel layouts can derive
    further streams with :meth:`DistributedRun.group_seed`.

    ``verify=True`` runs :func:`verify_across_ranks` after seeding on entry and
    before restoring on exit (skipped when the block exits with an exception:
    the other ranks may still be inside the body, in another collective).

    The switches are those of :class:`deterministic`. ``HCCL_DETERMINISTIC``
    is read by torch_npu when the first HCCL communicator is configured, so
    inside a block on an HCCL group it comes too late: a
    :class:`~detctx.errors.DeterminismWarning` names it and says to export it
    before launch (or call :func:`prepare_environment` in the launcher). A
    warning is also given when ``HCCL_LOGIC_SUPERPOD_ID`` is set.

    Every rank of the group must enter the same blocks in the same order, as
    with any collective. Outside a process group (a plain ``python train.py``)
    nothing is communicated and the block behaves like
    ``deterministic(seed, ...)``, the process being rank 0 of 1 (so
    ``per_rank=True`` seeds ``derive_seed(seed, 0)``, as a one-process
    ``torchrun`` launch would). Entering returns a :class:`DistributedRun`.
    """

    def __init__(
        self,
        seed: int | None = None,
        *,
        per_rank: bool = False,
        group: Any = None,
        src: int = 0,
        verify: bool = False,
        algorithms: bool | Literal["warn"] = True,
        cudnn: bool = True,
        hash_seed: bool = True,
        cublas_workspace: bool = True,
        hccl: bool | Literal["strict"] = True,
        matmul_k_shift: bool = True,
        flash_attention: bool = True,
    ) -> None:
        super().__init__(
            seed,
            algorithms=algorithms,
            cudnn=cudnn,
            hash_seed=hash_seed,
            cublas_workspace=cublas_workspace,
            hccl=hccl,
            matmul_k_shift=matmul_k_shift,
            flash_attention=flash_attention,
        )
        _check_arguments(None, per_rank, group, src)
        if not isinstance(verify, bool):
            raise TypeError(f"verify must be True or False, got {verify!r}")
        self.per_rank = per_rank
        self.group = group
        self.src = src
        self.verify = verify

    def __repr__(self) -> str:
        inner = super().__repr__()[len("deterministic(") : -1]
        extra = [
            f"{name}={value!r}"
            for name, value, default in (
                ("per_rank", self.per_rank, False),
                ("group", self.group, None),
                ("src", self.src, 0),
                ("verify", self.verify, False),
            )
            if value != default
        ]
        return f"distributed_deterministic({', '.join([inner, *extra])})"

    def _agree(self) -> tuple[int, int, int, int]:
        """Agree with the other ranks: (this rank's seed, shared seed, rank, world size)."""
        if self._options.settings["hccl"] is not False:
            _warn_superpod()
        shared, rank, world_size = _agree(self.seed, self.per_rank, self.group, self.src)
        seed = derive_seed(shared, rank) if self.per_rank else shared
        return seed, shared, rank, world_size

    def _resolve_seed(self) -> int:
        # The decorated generator/coroutine forms seed their world through this: a
        # collective on their first step, as entering a block is.
        return self._agree()[0]

    def __enter__(self) -> DistributedRun:
        seed, shared, rank, world_size = self._agree()
        settings: dict[str, Any] = dict(self._options.settings)
        inner = deterministic(seed, **settings)
        applied = inner.__enter__()
        run = DistributedRun(
            applied.seed, applied.sources, applied.switches, shared, rank, world_size, self.per_rank
        )
        frame = _DistFrame(self, inner, run, self.group)
        _open.set((*_open.get(), frame))
        if logger.isEnabledFor(logging.INFO):
            logger.info("seed agreed across ranks: %s", run.describe())
        if self.verify:
            try:
                verify_across_ranks(self.group)
            except BaseException:
                self._pop(frame)
                inner.__exit__(None, None, None)
                raise
        return run

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for frame in reversed(_open.get()):
            if frame.owner is self:
                break
        else:
            raise OutOfOrderExitError(f"{self!r} was exited without being entered in this context")
        try:
            if self.verify and exc_type is None:
                verify_across_ranks(self.group)
        finally:
            self._pop(frame)
            frame.inner.__exit__(exc_type, exc, tb)

    @staticmethod
    def _pop(frame: _DistFrame) -> None:
        _open.set(tuple(other for other in _open.get() if other is not frame))


def _warn_superpod() -> None:
    value = os.environ.get(SUPERPOD_ENV)
    if value:
        warnings.warn(
            f"{SUPERPOD_ENV} is set ({value!r}): over RoCE links, a change of cluster topology "
            f"changes HCCL's collective behaviour, so runs are only reproducible on the same "
            f"topology. Compare runs on the same superpod layout (or unset {SUPERPOD_ENV} "
            f"before launch when the job stays inside one superpod).",
            DeterminismWarning,
            stacklevel=3,
        )


# ---------------------------------------------------------------------------
# The launcher's part


def prepare_environment(
    seed: int | None = None,
    *,
    hccl: bool | Literal["strict"] = True,
    cublas_workspace: bool = True,
    matmul_k_shift: bool = True,
    flash_attention: bool = True,
    hash_seed: bool = True,
) -> dict[str, str]:
    """Set the determinism environment variables, and nothing else, for a launch.

    Call it in the launcher before ``init_process_group`` (and before any
    CUDA or NPU work, and before starting the worker processes, which inherit
    it): it sets ``HCCL_DETERMINISTIC`` (``true``, or ``strict``),
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (``:16:8`` is kept),
    ``CLOSE_MATMUL_K_SHIFT=1`` and ``FLASH_ATTENTION_DETERMINISTIC=1``; with a
    ``seed``, also ``DETCTX_SEED`` (read by ``seed=None`` blocks on the source
    rank) and ``PYTHONHASHSEED`` (the hash seed of the processes started
    afterwards). ``False`` leaves a variable alone. Nothing is seeded and
    nothing is restored. Returns the variables it manages with their values.
    Warns when a variable is set after the point where it is read (a CUDA
    context or an HCCL group already exists), and when ``HCCL_LOGIC_SUPERPOD_ID``
    is set.
    """
    checked = None if seed is None else validate_seed(seed)
    settings: dict[str, object] = {
        "hccl": hccl,
        "cublas_workspace": cublas_workspace,
        "matmul_k_shift": matmul_k_shift,
        "flash_attention": flash_attention,
        "hash_seed": hash_seed if checked is not None else False,
    }
    if checked is None and not isinstance(hash_seed, bool):
        raise TypeError(f"hash_seed must be True or False, got {hash_seed!r}")
    switches = [switch for switch in env_switches() if switch.name in settings]
    for switch in switches:
        switch.validate(settings[switch.name])
    if hccl is not False:
        _warn_superpod()
    applied: dict[str, str] = {}
    for switch in switches:
        if switch.apply(settings[switch.name], checked or 0, switch.capture()) is not None:
            applied[switch.variable] = os.environ[switch.variable]
    if checked is not None:
        os.environ[SEED_ENV] = str(checked)
        applied[SEED_ENV] = str(checked)
    return applied
