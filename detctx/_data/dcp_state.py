"""The resume state in a ``torch.distributed.checkpoint`` (DCP) state dict: every rank's own back.

DCP keeps one copy of a key that every rank saves (its planner deduplicates
them), so :func:`~detctx.resume_state`'s dict, saved as it is, gives every
rank one rank's RNG streams, or a mixture of several ranks' (saving ``{"pos":
100 + rank, "t": tensor([rank, rank])}`` on 2 ranks and loading in place gives
both ranks ``pos`` 100 and ``t`` [1, 1]). :class:`DCPResumeState` is a DCP
``Stateful``: on save it gathers every rank's resume state into one value that
every rank saves alike (so the one copy DCP keeps holds all of them), and on
load each rank picks its own and resumes from it through :func:`~detctx.resume`.
An elastic loader's position is global: it is kept once, and loads on another
world size (DCP reshards the weights; this, the loader).

The value is one ``bytes`` object, ``_MAGIC``, a 16-byte BLAKE2b digest of
the payload, then the payload, a ``torch.save`` of plain data read back with
``weights_only=True``: a damaged checkpoint is refused before anything is read
from it.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from typing import Any, Final

import torch

from detctx._basics import CheckpointError, open_envelope
from detctx._blocks import open_blocks
from detctx._data.elastic import ElasticLoader
from detctx._data.resuming import prepare_resume, resume_state
from detctx._data.together import ResumePlan, resume_together
from detctx.distributed import DEFAULT_TIMEOUT_S, check_timeout

__all__ = ["DCP_FORMAT", "DCPResumeState", "dcp_resume_state"]

DCP_FORMAT: Final = "detctx.dcp"
"""The ``"format"`` entry of the payload a :class:`DCPResumeState` saves."""

_VERSION: Final = 1
_MAGIC: Final = b"detctx.dcp\0"
_DIGEST_SIZE: Final = 16
_KEY: Final = "ranks"


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes, what: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{what} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is damaged "
            "or was not written by detctx.dcp_resume_state"
        ) from None


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=_DIGEST_SIZE).digest()


def _mesh_layout() -> dict[str, Any] | None:
    """The mesh of the innermost open ``distributed_deterministic(mesh=...)`` block: its dim
    names and its grid of ranks (where each rank's streams belong), or ``None``."""
    for seeding in reversed(open_blocks()):
        mesh_seeds = getattr(seeding, "mesh_seeds", None)
        if mesh_seeds is not None:
            mesh = mesh_seeds.mesh
            return {"dims": list(mesh.mesh_dim_names or ()), "ranks": mesh.mesh.tolist()}
    return None


class DCPResumeState:
    """:func:`~detctx.resume_state` for ``torch.distributed.checkpoint``: each rank gets its own.

    Built by :func:`dcp_resume_state`. DCP calls :meth:`state_dict` in
    ``dcp.save`` / ``dcp.async_save`` (a collective: every rank's resume state
    is gathered, so every rank saves the same value) and in ``dcp.load`` (for
    the shape of what to read), then :meth:`load_state_dict` with what it read.
    """

    def __init__(self, loaders: tuple[Any, ...], group: Any, timeout: float) -> None:
        resume_state(*loaders)  # the loaders checked now, not at the first save
        if group is not None and not isinstance(group, torch.distributed.ProcessGroup):
            raise TypeError(
                f"group must be a torch.distributed ProcessGroup or None (the default group), "
                f"got {type(group).__name__}"
            )
        self.loaders = loaders
        self.group = group
        self.timeout = check_timeout(timeout)

    def _where(self) -> tuple[int, int]:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return int(dist.get_rank(self.group)), int(dist.get_world_size(self.group))

    def state_dict(self) -> dict[str, bytes]:
        """``{"ranks": bytes}``: every rank's resume state and the elastic positions, digested."""
        _, world_size = self._where()
        elastic = [
            loader.state_dict() if isinstance(loader, ElasticLoader) else None
            for loader in self.loaders
        ]
        mine = (_to_bytes(resume_state(*self.loaders)), elastic)
        everyone: list[Any] = [mine]
        if world_size > 1:
            everyone = [None] * world_size
            torch.distributed.all_gather_object(everyone, mine, group=self.group)
        differ = [rank for rank, (_, theirs) in enumerate(everyone) if theirs != everyone[0][1]]
        if differ:
            # DCP would keep one rank's copy of the position and drop the others.
            raise CheckpointError(
                f"the elastic loaders stand at different positions on ranks {differ} than on "
                "rank 0: every rank must have taken the same number of batches when saving"
            )
        payload = _to_bytes(
            {
                "format": DCP_FORMAT,
                "version": _VERSION,
                "world_size": world_size,
                "ranks": [state for state, _ in everyone],
                "elastic": elastic,
                "mesh": _mesh_layout(),
            }
        )
        return {_KEY: _MAGIC + _digest(payload) + payload}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume this rank from what DCP read: its own resume state on the same world size,
        the elastic loaders' positions alone on another; every check before any change, and
        every rank of the group resumes or every rank refuses (one small collective)."""
        resume_together(
            lambda: self._plan(state),
            group=self.group,
            timeout=self.timeout,
            what="the DCP load of detctx.dcp_resume_state",
        )

    def _plan(self, state: Mapping[str, Any]) -> ResumePlan:
        payload = self._payload(state)
        rank, world_size = self._where()
        saved_world = payload["world_size"]
        if saved_world == world_size:
            self._check_mesh(payload.get("mesh"))
            mine = _from_bytes(payload["ranks"][rank], f"rank {rank}'s resume state")
            return prepare_resume(mine, self.loaders, strict=True, any_rank=False)
        if not all(isinstance(loader, ElasticLoader) for loader in self.loaders):
            raise CheckpointError(
                f"the checkpoint was saved on {saved_world} rank(s) and this run has "
                f"{world_size}: only elastic loaders (detctx.elastic_loader) continue on another "
                "world size; resume on the world size it was saved with"
            )
        positions = payload["elastic"]
        for index, (loader, position) in enumerate(zip(self.loaders, positions)):
            loader.check_state(position, where=f"the checkpoint's elastic loader {index}")
        return ResumePlan(self.loaders, positions, None, 0)

    def _check_mesh(self, saved: Any) -> None:
        here = _mesh_layout()
        if saved is not None and not isinstance(saved, Mapping):
            raise CheckpointError("the checkpoint's detctx entry has a damaged mesh layout")
        if saved is None or here is None or dict(saved) == here:
            return
        raise CheckpointError(
            f"the checkpoint was saved on a mesh with dims {saved.get('dims')} over ranks "
            f"{saved.get('ranks')}; this block's mesh has dims {here['dims']} over ranks "
            f"{here['ranks']}: each rank's RNG streams belong to its place in the saved mesh, "
            "so resume on the same mesh layout"
        )

    def _payload(self, state: Mapping[str, Any]) -> dict[str, Any]:
        blob = state.get(_KEY) if isinstance(state, Mapping) else None
        head = len(_MAGIC) + _DIGEST_SIZE
        if not isinstance(blob, bytes) or not blob.startswith(_MAGIC) or len(blob) < head:
            raise CheckpointError(
                "the checkpoint's detctx entry is not what detctx.dcp_resume_state saves: save "
                "and load the same dict, with dcp_resume_state(...) under the same key"
            )
        body = blob[head:]
        if _digest(body) != blob[len(_MAGIC) : head]:
            raise CheckpointError(
                "the checkpoint's detctx entry is damaged (its digest does not match its "
                "contents): nothing was resumed; load an intact checkpoint"
            )
        payload = open_envelope(
            _from_bytes(body, "the checkpoint's detctx entry"),
            DCP_FORMAT,
            _VERSION,
            what="the checkpoint's detctx entry",
            refusal="the checkpoint's detctx entry is not a detctx DCP resume state",
        )
        world_size, ranks, positions = (payload.get(k) for k in ("world_size", "ranks", "elastic"))
        if (
            type(world_size) is not int
            or world_size < 1
            or not isinstance(ranks, list)
            or len(ranks) != world_size
            or not all(isinstance(part, bytes) for part in ranks)
            or not isinstance(positions, list)
        ):
            raise CheckpointError(
                "the checkpoint's detctx entry has no resume state for each of its ranks: the "
                "checkpoint is damaged or was written by something else"
            )
        if len(positions) != len(self.loaders):
            raise CheckpointError(
                f"the checkpoint holds {len(positions)} loader state(s) but "
                f"{len(self.loaders)} loader(s) were passed: pass the loaders the run was saved "
                "with, in the same order"
            )
        return dict(payload)


def dcp_resume_state(
    *loaders: Any, group: Any = None, timeout: float = DEFAULT_TIMEOUT_S
) -> DCPResumeState:
    """:func:`~detctx.resume_state` for a ``torch.distributed.checkpoint`` state dict.

    Put it in the dict ``dcp.save`` (or ``dcp.async_save``) and ``dcp.load``
    take, under the same key; every rank gets its own RNG streams and loader
    positions back, which :func:`~detctx.resume_state`'s plain dict does not
    give there (DCP keeps one copy of a key every rank saves)::

        state = {"model": model.state_dict(), "detctx": detctx.dcp_resume_state(loader)}
        dcp.save(state, checkpoint_id=path)
        # a new launch, the same world size or another:
        state = {"model": model.state_dict(), "detctx": detctx.dcp_resume_state(loader)}
        dcp.load(state, checkpoint_id=path)      # detctx's part is checked and resumed here
        model.load_state_dict(state["model"])

    Saving gathers every rank's state over ``group`` (default: the default
    group), one ``all_gather_object``. On load, on the world size it was
    saved with, each rank resumes exactly as :func:`~detctx.resume` from its
    own state (every RNG, every loader; the same checks, nothing changed if
    one fails). On another world size only elastic loaders continue (their
    position is global, kept once): their positions are loaded and the RNGs
    are left as they are (a rank's streams have no counterpart there).
    :class:`~detctx.CheckpointError`, with nothing of detctx changed, for a
    damaged entry, an entry of another kind, another number of loaders, a
    resumable loader on another world size, another mesh layout (saved and
    loaded inside ``distributed_deterministic(mesh=...)`` blocks whose meshes
    differ in dim names or ranks), and everything ``resume`` refuses (a
    loader of another run: another seed, dataset or configuration; a rank's
    state found in another rank's place). The load is decided together over
    ``group``: if one rank refuses, every rank raises the same error, naming
    it and why, with nothing of detctx changed on any rank; a rank that waits
    more than ``timeout`` seconds for the others raises
    :class:`~detctx.SeedAgreementError`, nothing changed.
    """
    return DCPResumeState(loaders, group, timeout)
