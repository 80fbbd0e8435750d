"""A resume that every rank of a process group takes, or every rank refuses.

Each rank checks its own state (:class:`ResumePlan` is what passed the
checks), applies it, and then the ranks decide together in one small
collective (:func:`detctx.distributed.decide_together`): if any rank refused,
or failed to apply, every rank that applied puts back what it changed (the
RNGs captured just before, each loader's pending position) and every rank
raises the same :class:`~detctx.CheckpointError`. Applying before the vote
keeps it to one collective and still leaves nothing changed on any rank.
Outside a process group (or in a group of one) the plan is applied alone,
with the refusal raised as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from detctx._blocks import open_blocks
from detctx._state import Snapshot, capture
from detctx.distributed import DistributedSeeding, check_timeout, decide_together

__all__ = ["ResumePlan", "resume_together"]


class ResumePlan:
    """What a checked resume changes: each loader's state and the RNG snapshot (``None``:
    the RNGs are left as they are); ``key``: the run the state was saved in (0: unknown)."""

    __slots__ = ("before", "key", "loaders", "pending", "snapshot", "states")

    def __init__(
        self, loaders: Sequence[Any], states: Sequence[Any], snapshot: Snapshot | None, key: int
    ) -> None:
        self.loaders = tuple(loaders)
        self.states = tuple(states)
        self.snapshot = snapshot
        self.key = key
        self.pending: list[Any] = []
        self.before: Snapshot | None = None

    def apply(self, *, undoable: bool) -> None:
        """Load every loader's state and restore the RNGs; if anything raises, put the
        loaders back (a snapshot's restore is atomic). ``undoable``: keep what :meth:`undo`
        needs."""
        self.pending = [loader.pending() for loader in self.loaders]
        if undoable and self.snapshot is not None:
            self.before = capture()
        try:
            for loader, state in zip(self.loaders, self.states):
                loader.load_checked(state)
            if self.snapshot is not None:
                self.snapshot.restore()
        except BaseException:
            self._put_back_loaders()
            raise

    def undo(self) -> None:
        """Put back what :meth:`apply` changed (the RNGs first: the loaders cannot raise)."""
        try:
            if self.before is not None:
                self.before.restore()
        finally:
            self._put_back_loaders()

    def _put_back_loaders(self) -> None:
        for loader, before in zip(self.loaders, self.pending):
            loader.put_back(before)


def resume_together(
    prepare: Callable[[], ResumePlan], *, group: Any, timeout: float, what: str
) -> None:
    """Check (``prepare``) and apply on this rank, then keep it only if every rank of ``group``
    did (``None``: the innermost ``distributed_deterministic`` block's group, else the
    default group)."""
    timeout = check_timeout(timeout)
    group = group if group is not None else _block_group()
    together = _in_group(group)
    plan: ResumePlan | None = None
    refusal: Exception | None = None
    try:
        plan = prepare()
    except Exception as exc:
        if not together:
            raise
        refusal = exc
    if not together:
        assert plan is not None
        plan.apply(undoable=False)
        return
    applied = False
    if plan is not None:
        try:
            plan.apply(undoable=True)
            applied = True
        except Exception as exc:
            refusal = exc
    try:
        key = 0 if plan is None else plan.key
        decide_together(refusal, what=what, key=key, group=group, timeout=timeout)
    except BaseException:
        if applied and plan is not None:
            plan.undo()
        raise


def _block_group() -> Any:
    for seeding in reversed(open_blocks()):
        if isinstance(seeding, DistributedSeeding):
            return seeding.group
    return None


def _in_group(group: Any) -> bool:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return int(dist.get_world_size(group)) > 1
