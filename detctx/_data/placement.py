"""Where a resume state was saved: the rank, the world size and the run, checked on resume.

A resume state holds one rank's RNG streams. Without a record of the rank, a
state with no resumable loader (none, or only elastic ones, whose position is
global) resumed on another rank gave that rank the saver's streams: rank 1
drew rank 0's dropout masks. So every state records ``{"rank", "world_size",
"run"}`` inside its digest, and :func:`check_placement` refuses another rank's
or another world size's state unless the caller says it is meant.

The run identity is one id shared by every process of a launch
(:func:`detctx.distributed.run_identity`). The ranks that resume together
check that their states come from one run
(:func:`detctx.distributed.decide_together`).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from typing import Any, Final

from detctx._basics import CheckpointError
from detctx._data.loader import current_rank, current_world_size
from detctx.distributed import run_identity

__all__ = ["PLACEMENT_KEYS", "check_placement", "placement", "run_key"]

PLACEMENT_KEYS: Final = frozenset({"rank", "world_size", "run"})


def placement() -> dict[str, Any]:
    """``{"rank", "world_size", "run"}`` of this process, as a resume state records them."""
    return {"rank": current_rank(), "world_size": current_world_size(), "run": run_identity()}


def run_key(saved: Mapping[str, Any] | None) -> int:
    """A nonzero int64 for the run a checked placement names (0: none recorded)."""
    if saved is None:
        return 0
    digest = hashlib.blake2b(str(saved["run"]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


def check_placement(saved: object, *, any_rank: bool, what: str = "the resume state") -> None:
    """Raise :class:`~detctx.CheckpointError` unless ``saved`` is a placement of this rank
    and world size (``any_rank``: any rank and world size)."""
    if (
        not isinstance(saved, Mapping)
        or set(saved) != PLACEMENT_KEYS
        or not all(type(saved[key]) is int for key in ("rank", "world_size"))
        or not 0 <= saved["rank"] < saved["world_size"]
        or not isinstance(saved["run"], str)
    ):
        raise CheckpointError(
            f"{what}'s 'where' is not the rank, world size and run resume_state records: a "
            "corrupted or edited checkpoint; resume from another one"
        )
    if any_rank:
        return
    rank, world_size = current_rank(), current_world_size()
    if (saved["rank"], saved["world_size"]) == (rank, world_size):
        return
    raise CheckpointError(
        f"{what} was saved on rank {saved['rank']} of {saved['world_size']}, and this is rank "
        f"{rank} of {world_size}: its RNG streams are that rank's, and this rank would draw "
        "them again. Resume each rank from the state it saved (one file per rank, or "
        "detctx.dcp_resume_state in a torch.distributed.checkpoint), or pass any_rank=True if "
        f"taking that rank's streams here is meant{through_dcp()}"
    )


def through_dcp() -> str:
    """The way out where ``torch.distributed.checkpoint`` is imported, else ``""``."""
    # DCP saves a key every rank holds once and loads that one copy into every rank (rank 0's
    # plain values; each tensor from whichever rank it chose), so detctx.resume_state's dict
    # put in a DCP state dict comes back as rank 0's on rank 1, mixed on rank 0.
    if "torch.distributed.checkpoint" not in sys.modules:
        return ""
    return (
        ". If it went through torch.distributed.checkpoint (dcp.save of "
        "detctx.resume_state(...)), DCP kept one rank's copy of its keys for every rank: put "
        "detctx.dcp_resume_state(loaders) in the DCP state dict instead, which gives each "
        "rank its own state back"
    )
