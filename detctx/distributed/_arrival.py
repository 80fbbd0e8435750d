"""A gather that every rank leaves in bounded time, knowing who did not arrive.

detctx's collectives (seed agreement on entry, verification on exit) are
``all_gather`` calls that wait at most ``timeout`` seconds. When one times
out (a rank never entered the block, or crashed), each waiting rank leaves
its mark in the process group's store and looks, for as long again, for
the marks of the others: a rank whose mark never appears did not arrive
within ``timeout`` of this one. So every waiting rank raises the same
:class:`~detctx.SeedAgreementError`, naming the missing ranks,
whatever the backend, without a second collective (after a timeout gloo
closes the connections it timed out on; run two ranks of which one skips
``all_gather`` with ``async_op=True`` and ``wait(timeout)``, then try any
collective: "Application timeout caused pair closure").

Nothing is written to the store unless a gather fails, so the usual path
costs the ``all_gather`` alone.

A timeout leaves the group unusable, so it is remembered: a later gather on
that group raises at once, and the exit check of an enclosing
``verify=True`` block is skipped while a timeout propagates
(:func:`timed_out`). Without that, a rank whose inner block timed out waited
again in the outer block's exit check: 6.1 s with ``timeout=1.5``, against
the documented bound of twice ``timeout``.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import torch

from detctx._basics import SeedAgreementError, own_work
from detctx.distributed._topology import collective_device

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "check_timeout",
    "default_store",
    "gather_rows",
    "missing_text",
    "ranks_by_label",
    "ranks_text",
    "timed_out",
]

DEFAULT_TIMEOUT_S: Final = 300.0
"""How long a rank waits for the others in one of detctx's collectives (5 minutes)."""

_POLL_S: Final = 0.05
_serials: dict[str, int] = {}


@dataclass(frozen=True)
class _Timeout:
    """A gather that timed out, on ``group`` (the object: a group destroyed and created
    again under the same name is another one)."""

    group: Any
    what: str
    missing: tuple[int, ...] | None


_timed_out: dict[str, _Timeout] = {}
"""The last gather that timed out on each group, by group key."""

_timeout_errors: weakref.WeakSet[BaseException] = weakref.WeakSet()
"""The errors raised for those timeouts, for :func:`timed_out`."""


def check_timeout(timeout: object) -> float:
    """``timeout`` in seconds, checked: a positive, finite int or float."""
    np = sys.modules.get("numpy")
    numeric = isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
    if not numeric or (np is not None and isinstance(timeout, np.bool_)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    seconds = float(timeout)  # type: ignore[arg-type]
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    return seconds


def gather_rows(
    row: Sequence[int], group: Any, rank: int, world_size: int, timeout: float, what: str
) -> list[list[int]]:
    """Every rank's ``row`` (int64s), in group-rank order, waiting at most ``timeout`` seconds.

    ``what`` names the collective in the error (``"the seed agreement"``).
    """
    dist = torch.distributed
    key = _group_key(group)
    resolved = dist.group.WORLD if group is None else group
    earlier = _timed_out.get(key)
    if earlier is not None and earlier.group is resolved:
        error = SeedAgreementError(
            f"rank {rank}: {what} was not attempted: {earlier.what} timed out on this "
            f"process group before ({missing_text(earlier.missing)}), which left the group "
            "unusable; stop the job, or destroy and re-create the group.",
            missing=earlier.missing,
        )
        _timeout_errors.add(error)
        raise error
    serial = _serials[key] = _serials.get(key, 0) + 1
    device = collective_device(str(dist.get_backend(group)))
    with own_work():  # not the program's: a recording skips it
        mine = torch.tensor(list(row), dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        work = dist.all_gather(gathered, mine, group=group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as exc:
            missing = _missing_ranks(f"detctx/arrival/{key}/{serial}", rank, world_size, timeout)
            _timed_out[key] = _Timeout(resolved, what, missing)
            error = SeedAgreementError(
                f"rank {rank}: {what} did not complete within {timeout:g} s: "
                f"{missing_text(missing)}. Every rank of the group must enter the same "
                f"distributed_deterministic blocks (and verify_across_ranks calls) in the same "
                f"order; a rank that skipped one, crashed or is stuck elsewhere keeps the others "
                f"waiting. The process group is not usable after this; stop the job.",
                missing=missing,
            )
            _timeout_errors.add(error)
            raise error from exc
        rows: list[list[int]] = torch.stack(gathered).cpu().tolist()
    return rows


def timed_out(raised: BaseException | None) -> bool:
    """Whether ``raised``, or an exception it was raised from or while handling, is the
    error of a gather that timed out (or was refused after one)."""
    seen: set[int] = set()
    while raised is not None and id(raised) not in seen:
        if raised in _timeout_errors:
            return True
        seen.add(id(raised))
        raised = raised.__cause__ or raised.__context__
    return False


def missing_text(missing: tuple[int, ...] | None) -> str:
    """How a :class:`SeedAgreementError` names the ranks that did not arrive."""
    if missing is None:
        return "which ranks did not arrive cannot be told (no process group store reachable)"
    if not missing:
        return "every rank arrived, but not within the timeout of this one"
    return f"{ranks_text(missing)} did not arrive"


def ranks_text(ranks: Sequence[int]) -> str:
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


def ranks_by_label(labels: Mapping[int, str]) -> dict[str, list[int]]:
    """The ranks that share each label, labels in order of their lowest rank."""
    ranks_of: dict[str, list[int]] = {}
    for rank, label in labels.items():
        ranks_of.setdefault(label, []).append(rank)
    return ranks_of


def _missing_ranks(
    prefix: str, rank: int, world_size: int, timeout: float
) -> tuple[int, ...] | None:
    """Mark this rank's arrival in the store and wait up to ``timeout`` for the others'.

    Arrivals are counters (``store.add``): reading one never waits, on every store and
    torch release. (A ``wait`` of a millisecond, the only check torch 2.1's stores have,
    timed out on a loaded machine for keys that were there, and named ranks that had
    arrived, this one included.)
    """
    store = default_store()
    if store is None:
        return None
    try:
        store.add(f"{prefix}/{rank}", 1)
        arrived = store.add(f"{prefix}/count", 1)
        deadline = time.monotonic() + timeout
        # One round trip per poll while waiting; rank by rank only once, at the end.
        while arrived < world_size:
            if time.monotonic() >= deadline:
                return tuple(
                    other
                    for other in range(world_size)
                    if other != rank and store.add(f"{prefix}/{other}", 0) == 0
                )
            time.sleep(_POLL_S)
            arrived = store.add(f"{prefix}/count", 0)
        return ()
    except (RuntimeError, ValueError):
        # The store lives in one rank's process (or torchrun's agent); it may be gone.
        return None


def default_store() -> Any:
    """The default process group's store, or ``None`` where it cannot be reached."""
    c10d = torch.distributed.distributed_c10d
    get_store = getattr(c10d, "_get_default_store", None)  # private; absent in some releases
    if get_store is None:
        return None
    try:
        return get_store()
    except (RuntimeError, ValueError):
        return None


def _group_key(group: Any) -> str:
    dist = torch.distributed
    resolved = dist.group.WORLD if group is None else group
    name = getattr(resolved, "group_name", None)
    if isinstance(name, str) and name:
        return name
    get_ranks = getattr(dist, "get_process_group_ranks", None)
    if get_ranks is None:
        return "default"
    return ",".join(str(r) for r in get_ranks(resolved))
