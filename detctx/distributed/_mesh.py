"""Seeds from a ``DeviceMesh`` as torchtitan derives them, and DTensor's RNG tracker with the block.

torchtitan's ``set_determinism(parallel_dims, device, debug_config,
distinct_seed_mesh_dims)`` seeds every rank of an SPMD group alike (DTensor's
random ops rely on it) and makes only the named mesh dims distinct: ``seed +
sum(local_rank(d_i) * prod(size(d_j), j < i))`` over those dims in order
(:func:`detctx._basics.mesh_seed`). :class:`MeshSeeds` is that derivation for
this rank, read from the mesh once, when the block is built.

DTensor's random ops run inside its RNG tracker's region. In torch 2.13 the
tracker keeps no state of its own (it offsets the device generator, which the
block seeds and restores anyway), but if none exists when the first random
DTensor op runs, one is made that broadcasts rank 0's device state to every
rank, undoing distinct per-stage seeds; torchtitan avoids that with
``torch.distributed.tensor._random.manual_seed(seed, mesh)``. The block calls
it on entry and puts the previous tracker back on exit
(:class:`TrackerEntry`). Only for device types with a settable RNG state: on a
CPU mesh torch makes no tracker (``OffsetBasedRNGTracker`` refuses CPU) and
DTensor's random ops draw each local shard from torch's CPU generator, which
the block seeds.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from detctx._basics import mesh_seed
from detctx._sources import device_module

__all__ = ["MeshSeeds", "TrackerEntry", "check_mesh_seeds"]


@dataclass(frozen=True)
class MeshSeeds:
    """This rank's seed derived from the agreed one over a ``DeviceMesh``, as torchtitan does.

    ``distinct_dims``: the mesh dims whose ranks get distinct seeds, in order;
    ``local_ranks`` and ``sizes``: this rank's coordinate along each and each
    one's size (0 and 1 for a dim the mesh leaves out, as torchtitan takes
    it). Ranks that differ only in the other dims get the same seed.
    """

    distinct_dims: tuple[str, ...]
    local_ranks: tuple[int, ...]
    sizes: tuple[int, ...]
    mesh: Any = field(repr=False, compare=False)

    def seed_for(self, seed: int) -> int:
        """This rank's seed when the ranks agreed on ``seed``."""
        return mesh_seed(seed, self.local_ranks, self.sizes)

    def fingerprint(self) -> int:
        """A 40-bit number that differs between meshes (their dim names or grids) or distinct
        dims (the agreement row)."""
        names = tuple(getattr(self.mesh, "mesh_dim_names", None) or ())
        text = f"{self.distinct_dims}\0{names}\0{_shape(self.mesh).tolist()}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=5).digest(), "little")


def check_mesh_seeds(
    mesh: object, distinct_dims: object, *, per_rank: object, megatron_seeds: object
) -> MeshSeeds | None:
    """``mesh`` and ``distinct_dims`` checked (else ``TypeError`` / ``ValueError``): this rank's
    :class:`MeshSeeds`, or ``None`` without a mesh."""
    if mesh is None:
        if distinct_dims:
            raise ValueError(
                "distinct_dims names dims of a DeviceMesh: pass mesh= (the world mesh) too"
            )
        return None
    if per_rank is True or megatron_seeds is not None:
        given = "per_rank=True" if per_rank is True else "megatron_seeds"
        raise ValueError(
            f"mesh= and {given} both derive each rank's seed: pass one of them (mesh= with "
            f"distinct_dims=(...) gives distinct seeds along the dims it names)"
        )
    names: tuple[str, ...] = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    get_coordinate = getattr(mesh, "get_coordinate", None)
    if get_coordinate is None or not hasattr(mesh, "mesh"):
        raise TypeError(
            f"mesh must be a torch.distributed DeviceMesh (init_device_mesh(...)), got "
            f"{type(mesh).__name__}"
        )
    dims = _dims(distinct_dims)
    if dims and not names:
        raise ValueError(
            "the mesh has no dim names: build it with init_device_mesh(..., "
            "mesh_dim_names=(...)) so that distinct_dims can name its dims"
        )
    coordinate = get_coordinate()
    if coordinate is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        raise ValueError(
            f"rank {rank} is not in the mesh (its ranks: {_shape(mesh).tolist()}): enter the "
            f"block only on the mesh's ranks, or pass the mesh this rank belongs to"
        )
    shape = tuple(int(size) for size in _shape(mesh).shape)
    # A dim the mesh leaves out is a dim of size 1 (local rank 0), as torchtitan takes it: its
    # trainer passes ["pp"] on meshes that leave pp out when pp=1.
    indices = [names.index(dim) if dim in names else None for dim in dims]
    return MeshSeeds(
        dims,
        tuple(0 if index is None else int(coordinate[index]) for index in indices),
        tuple(1 if index is None else shape[index] for index in indices),
        mesh,
    )


def _dims(distinct_dims: object) -> tuple[str, ...]:
    if isinstance(distinct_dims, str) or not isinstance(distinct_dims, Sequence):
        raise TypeError(
            f"distinct_dims must be a sequence of mesh dim names, such as ('pp',), got "
            f"{distinct_dims!r}"
        )
    if not all(isinstance(dim, str) for dim in distinct_dims):
        raise TypeError(f"distinct_dims must hold dim names (strings), got {distinct_dims!r}")
    if len(set(distinct_dims)) != len(distinct_dims):
        raise ValueError(f"distinct_dims names a dim twice: {list(distinct_dims)}")
    return tuple(distinct_dims)


def _shape(mesh: Any) -> torch.Tensor:
    ranks: torch.Tensor = mesh.mesh
    return ranks


class TrackerEntry:
    """DTensor's RNG tracker for one entry: seeded (torchtitan's way) on entry, the previous
    one put back on exit. Does nothing where torch has no tracker for the mesh's devices."""

    __slots__ = ("before", "module", "states")

    def __init__(self, mesh: Any, seed: int) -> None:
        self.module = _tracker_module(str(getattr(mesh, "device_type", "cpu")))
        self.before: Any = None
        self.states: dict[str, torch.Tensor] | None = None
        if self.module is None:
            return
        self.before = self.module._rng_tracker
        self.states = _tracker_states(self.before)
        # What torchtitan's set_determinism calls: it makes the tracker without syncing
        # rank 0's device state to every rank (which would undo distinct seeds) and seeds
        # torch with this rank's seed, which the block has just done too.
        self.module.manual_seed(seed, mesh)

    def restore(self) -> None:
        """Put back the tracker (and any state of its own) from before the entry."""
        if self.module is None:
            return
        self.module._rng_tracker = self.before
        if self.states is not None:
            self.before.rng_states.update(self.states)


def _tracker_module(device_type: str) -> Any:
    """``torch.distributed.tensor._random`` where it makes trackers for ``device_type``."""
    module = device_module(device_type) if device_type != "cpu" else None
    if module is None or not callable(getattr(module, "set_rng_state", None)):
        return None  # CPU: OffsetBasedRNGTracker raises RuntimeError for it (torch 2.13)
    try:
        random = importlib.import_module("torch.distributed.tensor._random")
    except ImportError:
        return None
    tracker = getattr(random, "OffsetBasedRNGTracker", None)
    if tracker is None or not hasattr(random, "_rng_tracker") or not hasattr(random, "manual_seed"):
        return None
    try:
        parameters = inspect.signature(tracker).parameters
    except (TypeError, ValueError):
        return None
    # Older trackers take no run_state_sync and always broadcast rank 0's state, and their
    # manual_seed wants one seed on every rank: left alone.
    return random if "run_state_sync" in parameters else None


def _tracker_states(tracker: Any) -> dict[str, torch.Tensor] | None:
    states = getattr(tracker, "rng_states", None)
    if not isinstance(states, dict):
        return None
    return {name: state.clone() for name, state in states.items()}
