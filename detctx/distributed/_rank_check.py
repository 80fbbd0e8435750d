"""Cross-rank verification: prove, in one small ``all_gather``, that the ranks' RNGs agree.

Each rank sends one row of int64s: how it is seeded (outside a block, the
same stream on every rank, per-rank streams, or Megatron's offsets), the
agreed seed, its own seed and rank, a fingerprint of the set of compared
parts, one 8-byte fingerprint per part and one scope key per part. A part is
a source's whole state, unless the source splits it with
``agreement_parts(state)`` into named parts, each with the *scope* within
which it must agree (Megatron's tracker: its model-parallel state within
ranks of one tensor-parallel rank). Every rank compares each part with the
majority of the ranks that share its scope (and, under Megatron's offsets,
its seed) and raises the same :class:`~detctx.RankDivergenceError`.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any, Final

from detctx._basics import RankDivergenceError, SeedAgreementError, derive_seed
from detctx._blocks import stack as blocks
from detctx._sources import AcceleratorSource, RNGSource
from detctx._state import Snapshot, active_sources
from detctx.distributed._agreement import DistributedSeeding, check_arguments
from detctx.distributed._arrival import (
    DEFAULT_TIMEOUT_S,
    check_timeout,
    gather_rows,
    ranks_by_label,
    ranks_text,
)
from detctx.distributed._topology import in_process_group, rank_and_size

__all__ = [
    "compare_rows",
    "innermost_seeding",
    "verification_row",
    "verify_across_ranks",
    "verify_on_exit",
]

# Fingerprint slots in a verification row, then as many scope keys; parts beyond
# the last slot are folded into it, which keeps the row the same size on every rank.
_SLOTS: Final = 32
_OUTSIDE, _SHARED, _PER_RANK, _OFFSETS = 0, 1, 2, 3
# The scope key of a part compared with no other rank.
_ALONE: Final = 0
# On leaving a verify=True block each row starts with [raised, 5 words of the class name].
_NAME_WORDS: Final = 5
_OUTCOME: Final = 1 + _NAME_WORDS


def innermost_seeding() -> DistributedSeeding | None:
    """What the innermost ``distributed_deterministic`` block open in this context applied."""
    for block in reversed(blocks.entered_here()):
        if isinstance(block.seeding, DistributedSeeding):
            return block.seeding
    return None


def verify_across_ranks(group: Any = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Check, in one small ``all_gather``, that the ranks' RNG states agree.

    Each rank sends, for every managed RNG source, an 8-byte fingerprint of
    its state (for an accelerator: the state of this rank's current device,
    the one it draws from), plus the agreed seed and a fingerprint of the set
    of source names. Every rank then raises the same
    :class:`~detctx.RankDivergenceError`, naming the ranks and the
    sources that differ from the majority (on a tie, from the lowest rank's).

    A source whose state should agree only within some ranks says so with an
    ``agreement_parts(state)`` method (see :class:`~detctx.RNGSource`): each
    part is then compared only among the ranks that give it the same scope.
    Megatron's tracker (:mod:`detctx.integrations.megatron`) compares its
    model-parallel state among ranks of the same tensor-parallel rank, for
    instance. Under ``megatron_seeds`` each rank's seed carries its pipeline
    offset, so ranks are compared only with ranks seeded alike.

    Inside a ``per_rank=True`` block the states differ by design, so they are
    not compared; what must agree is what was derived from the shared seed:
    the shared seed itself, each rank's seed being
    ``derive_seed(shared_seed, rank)``, and the set of managed sources. (A rank
    that drew extra numbers from its own per-rank stream cannot be told from
    the others; compare runs with :func:`detctx.fingerprint` for that.)

    ``group`` defaults to the group of the innermost enclosing
    :class:`distributed_deterministic` block, else the default group. Every
    rank of the group must call it, and each waits at most ``timeout`` seconds
    for the others (then :class:`~detctx.SeedAgreementError`, naming
    the ranks that did not arrive). Outside a process group, or in a group of
    one, there is nothing to compare and it returns at once. Nothing is changed.

    Call it inside the block, where every rank is in the agreed state: after
    the block each rank has put back its own state from before the block,
    which differs across ranks whenever they drew different amounts before::

        with detctx.distributed_deterministic(seed=1234):
            train_step()
            detctx.verify_across_ranks()
    """
    _verify(group, check_timeout(timeout), None, outcome=False)


def verify_on_exit(group: Any, timeout: float, raised: BaseException | None) -> None:
    """The check on leaving a ``verify=True`` block, taken part in whatever happened.

    One gather of each rank's outcome (did it raise inside the block, and
    what) and its verification row. If a rank raised, the others raise
    :class:`~detctx.SeedAgreementError` saying which rank raised what,
    not a misleading divergence; the rank that raised returns (its own
    exception goes on). Otherwise as :func:`verify_across_ranks`.
    """
    _verify(group, timeout, raised, outcome=True)


def _verify(group: Any, timeout: float, raised: BaseException | None, *, outcome: bool) -> None:
    seeding = innermost_seeding()
    if group is None and seeding is not None:
        group = seeding.group
    check_arguments(seed=None, per_rank=False, group=group, src=0)
    if not in_process_group():
        return
    rank, world_size = rank_and_size(group)
    if world_size == 1:
        return
    sources = sorted(active_sources(), key=lambda item: item[0])
    row, names = verification_row(seeding, sources)
    if not outcome:
        rows = gather_rows(row, group, rank, world_size, timeout, "the verification")
        divergent = compare_rows(rows, row, names)
    else:
        head = _outcome_row(raised)
        rows = gather_rows(
            [*head, *row], group, rank, world_size, timeout, "the verification on leaving"
        )
        failed = {other: _name_of(full[1:_OUTCOME]) for other, full in enumerate(rows) if full[0]}
        if raised is not None:
            return
        if failed:
            raise SeedAgreementError(_failure_message(failed), failed=failed)
        divergent = compare_rows([full[_OUTCOME:] for full in rows], row, names)
    if divergent:
        raise RankDivergenceError(_divergence_message(divergent, world_size), divergent)


def _outcome_row(raised: BaseException | None) -> list[int]:
    if raised is None:
        return [0] * _OUTCOME
    name = type(raised).__qualname__.encode("ascii", "replace")[: 8 * _NAME_WORDS]
    padded = name.ljust(8 * _NAME_WORDS, b"\0")
    words = [
        int.from_bytes(padded[i : i + 8], "little", signed=True) for i in range(0, len(padded), 8)
    ]
    return [1, *words]


def _name_of(words: Sequence[int]) -> str:
    raw = b"".join(word.to_bytes(8, "little", signed=True) for word in words)
    return raw.rstrip(b"\0").decode("ascii", "replace") or "an exception"


def _failure_message(failed: dict[int, str]) -> str:
    ranks_of = ranks_by_label(failed)
    what = "; ".join(f"{ranks_text(ranks)} raised {name}" for name, ranks in ranks_of.items())
    return (
        f"{what} inside the distributed_deterministic block (verify=True); this rank left "
        f"it normally. The RNG states were not compared. See that rank's traceback for the "
        f"cause."
    )


def verification_row(
    run: DistributedSeeding | None, sources: list[tuple[str, RNGSource]]
) -> tuple[list[int], list[str]]:
    """``[mode, shared seed, seed, rank, parts fingerprint, count, slot..., scope...]``, and
    the names of the parts compared (source names, or ``name[part]``)."""
    slots = [0] * _SLOTS
    scopes = [_ALONE] * _SLOTS
    if run is None:
        header = [_OUTSIDE, -1, -1, -1]
    elif run.per_rank:
        header = [_PER_RANK, run.shared_seed, run.seed, run.rank]
    elif run.megatron_seeds is not None or run.mesh_seeds is not None:
        header = [_OFFSETS, run.shared_seed, run.seed, run.rank]
    else:
        header = [_SHARED, run.shared_seed, run.seed, run.rank]
    if run is not None and run.per_rank:
        names = [name for name, _ in sources]
    else:
        states = Snapshot.capture(sources)
        parts = [part for name, source in sources for part in _parts(name, source, states[name])]
        names = [name for name, _, _ in parts]
        # Under Megatron's or a mesh's offsets a rank is compared only with ranks seeded alike.
        alike = run is None or (run.megatron_seeds is None and run.mesh_seeds is None)
        seeded = "" if alike or run is None else f"\0seed={run.seed}"
        folded_scopes = hashlib.blake2b(digest_size=8)
        folded = hashlib.blake2b(digest_size=8)
        alone = False
        for index, (_, scope, fingerprint) in enumerate(parts):
            key = _ALONE if scope is None else (_int64(_digest(scope + seeded)) or 1)
            if index < _SLOTS - 1 or len(parts) == _SLOTS:
                slots[index], scopes[index] = fingerprint, key
            else:
                # Folded parts are compared with ranks whose folded scopes are the same.
                alone = alone or key == _ALONE
                folded.update(fingerprint.to_bytes(8, "little", signed=True))
                folded_scopes.update(key.to_bytes(8, "little", signed=True))
                slots[_SLOTS - 1] = _int64(folded)
                scopes[_SLOTS - 1] = _ALONE if alone else (_int64(folded_scopes) or 1)
    names_key = _int64(_digest("\0".join(names)))
    return [*header, names_key, len(names), *slots, *scopes], names


def _parts(name: str, source: RNGSource, state: Any) -> list[tuple[str, str | None, int]]:
    """``(name, scope, fingerprint)`` of each part of one source's state compared across ranks.

    A source without ``agreement_parts`` is one part, to agree on every rank
    (scope ``""``); a scope of ``None`` is compared with no other rank.
    """
    split = getattr(source, "agreement_parts", None)
    if split is None:
        return [(name, "", _source_fingerprint(name, source, state))]
    parts = []
    for part, scope, value in split(state):
        label = f"{name}[{part}]"
        digest = Snapshot({label: (source, value)}).fingerprint()
        parts.append((label, scope, int.from_bytes(bytes.fromhex(digest), "little", signed=True)))
    return parts


def _source_fingerprint(name: str, source: RNGSource, state: Any) -> int:
    if isinstance(source, AcceleratorSource) and isinstance(state, tuple) and len(state) > 1:
        # Each rank seeds every visible device but draws from its own: compare that one only.
        state = (state[int(source.module.current_device())],)
    digest = Snapshot({name: (source, state)}).fingerprint()
    return int.from_bytes(bytes.fromhex(digest), "little", signed=True)


def _digest(text: str) -> Any:
    return hashlib.blake2b(text.encode(), digest_size=8)


def _int64(digest: Any) -> int:
    return int.from_bytes(digest.digest(), "little", signed=True)


def _reference(values: Sequence[int]) -> int:
    """The most common value; on a tie, the one the lowest rank holds."""
    counts = Counter(values)
    most = max(counts.values())
    return next(value for value in values if counts[value] == most)


def compare_rows(
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
            label = _slot_label(slot, count, names if mine[4] == names_key else None)
            for rank in _differing(rows, same, slot):
                found.setdefault(rank, []).append(label)
    return {rank: tuple(found[rank]) for rank in sorted(found)}


def _differing(rows: list[list[int]], ranks: list[int], slot: int) -> list[int]:
    """The ranks whose part in ``slot`` differs from the majority of the ranks sharing its scope."""
    by_scope: dict[int, list[int]] = {}
    for rank in ranks:
        key = rows[rank][6 + _SLOTS + slot]
        if key != _ALONE:
            by_scope.setdefault(key, []).append(rank)
    differing: list[int] = []
    for members in by_scope.values():
        reference = _reference([rows[rank][6 + slot] for rank in members])
        differing.extend(rank for rank in members if rows[rank][6 + slot] != reference)
    return sorted(differing)


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
    ranks_of = ranks_by_label(labels)
    return "; ".join(f"{ranks_text(ranks)}: {label}" for label, ranks in ranks_of.items())
