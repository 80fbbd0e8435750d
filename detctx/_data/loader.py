"""Reproducible DataLoader workers: a worker seeder and a loader generator.

How a ``torch.utils.data.DataLoader`` draws randomness: each time it is
iterated it draws a base seed (and, when shuffling, the sampler's order) from
its ``generator``, or from torch's global generator when it has none; worker
``i`` then seeds ``random`` and torch with ``base_seed + i`` and NumPy with a
hash of both. So with a dedicated generator the data order and the workers'
seeds depend on that generator alone, not on how much randomness the model
consumed, and they are distinct per worker.

Distinct per rank too: the rank travels with the generator. Inside a worker
the rank is often unknown (a worker started with ``spawn`` or ``forkserver``
has no process group, and ``torch.multiprocessing.spawn`` or Lightning's
``ddp_spawn`` set no ``$RANK``), so :func:`loader_generator` mixes the rank
of the process that builds the loader into the generator's seed. Each rank's
workers then start from their own base seed, and :func:`seed_worker` derives
from it, the worker id and whatever rank the worker can see one seed per RNG
source, seeding Python's ``random``, NumPy's global generator, torch's CPU
generator and any registered user source in the worker.

These are not the numbers of Lightning's ``pl_worker_init_function``
(``seed_everything(seed, workers=True)``): it seeds torch, ``random`` and
NumPy only, from a bit-packing of (base seed, worker, rank) whose mixing
changed between Lightning releases; matching it would tie detctx's numbers
to one Lightning release and leave registered sources out. Under
:class:`~detctx.integrations.lightning.DeterministicCallback` Lightning's own
function runs, so there the numbers are Lightning's.
"""

from __future__ import annotations

import os
from typing import Final

import torch

from detctx._basics import loader_seed, parse_seed, validate_seed, worker_seed
from detctx._sources import registered_sources

__all__ = ["current_rank", "current_world_size", "loader_generator", "seed_worker"]

_RANK_VARIABLES: Final = ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def loader_generator(seed: int | None = None, *, rank: int | None = None) -> torch.Generator:
    """A CPU ``torch.Generator`` for ``DataLoader(generator=...)``, one per rank.

    It drives the loader's shuffling and its workers' base seeds, so both
    repeat run to run and no longer depend on the global torch stream (an
    extra ``torch.rand`` in the training loop does not change the data
    order). Its seed is derived (hashed) from ``seed`` and ``rank``, so its
    stream is not the global stream of the same seed. ``seed=None``:
    ``torch.initial_seed()``, which inside ``deterministic(seed=s)`` or after
    ``seed_all(s)`` / ``torch.manual_seed(s)`` is ``s`` and otherwise differs
    per process. ``rank=None``: :func:`current_rank` here, in the process
    that builds the loader, where the process group or ``$RANK`` is known.

    So each rank's workers get their own seeds, and a loader that shuffles
    with this generator (``shuffle=True`` without a ``DistributedSampler``)
    reads its own order on each rank; a ``DistributedSampler`` shuffles by its
    own seed and epoch, so the split between ranks does not change. For the
    same order on every rank, pass ``rank=0`` everywhere and
    ``worker_init_fn=functools.partial(seed_worker, rank=r)`` for distinct
    workers. To checkpoint its position, ``register_source("loader", generator)``.
    """
    base = torch.initial_seed() if seed is None else validate_seed(seed)
    rank = current_rank() if rank is None else validate_seed(rank, "rank")
    generator = torch.Generator()
    generator.manual_seed(loader_seed(base, rank))
    return generator


def current_rank() -> int:
    """The process's global rank: from ``torch.distributed`` when it is initialised,
    else from ``$RANK`` (torchrun), ``$SLURM_PROCID`` or ``$JSM_NAMESPACE_RANK``, else 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    for variable in _RANK_VARIABLES:
        value = os.environ.get(variable, "")
        if value.strip():
            try:
                return parse_seed(value, f"${variable}")
            except ValueError as exc:
                raise ValueError(
                    f"{exc}: it is read as this process's rank; fix or unset it, or pass "
                    "rank= to seed_worker and loader_generator"
                ) from None
    return 0


def current_world_size() -> int:
    """The number of ranks: from ``torch.distributed`` when it is initialised, else
    ``$WORLD_SIZE`` (torchrun), else 1."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    value = os.environ.get("WORLD_SIZE", "")
    if not value.strip():
        return 1
    try:
        return parse_seed(value, "$WORLD_SIZE")
    except ValueError as exc:
        raise ValueError(f"{exc}: it is read as the number of ranks; fix or unset it") from None


def seed_worker(worker_id: int, rank: int | None = None) -> None:
    """``DataLoader(worker_init_fn=detctx.seed_worker)``: seed a worker per worker and rank.

    From the worker's torch seed (``base_seed + worker_id``, set by the
    DataLoader; the loader's ``generator`` decides ``base_seed``) and the
    global rank (``rank``, else :func:`current_rank`) it derives, through
    NumPy's ``SeedSequence``, a seed for each RNG source and seeds Python's
    ``random``, NumPy's global generator, torch's CPU generator and every
    registered user source (with fork-started workers, those registered in
    the parent). Accelerators are left alone: workers must not touch devices.

    The result is the same for the same generator seed, worker and rank, and
    different across workers. It differs across ranks when the loader's
    generator is a :func:`loader_generator` (built on each rank, it carries
    the rank into the worker's seed) or when the worker sees the rank; a
    worker started with ``spawn`` under ``torch.multiprocessing.spawn`` sees
    neither a process group nor ``$RANK``, and reads rank 0. Use
    ``functools.partial(seed_worker, rank=r)`` to name the rank yourself.

    It only runs inside a DataLoader worker: called anywhere else it raises
    ``RuntimeError`` before anything is seeded (there is no worker seed to
    derive from, and it would reseed this process's own RNGs for good).
    """
    worker_id = validate_seed(worker_id, "worker_id")
    rank = current_rank() if rank is None else validate_seed(rank, "rank")
    info = torch.utils.data.get_worker_info()
    if info is None:
        raise RuntimeError(
            f"seed_worker({worker_id}) was called outside a DataLoader worker: it is a "
            "worker_init_fn, which the DataLoader calls in each worker process. Pass it as "
            "DataLoader(..., num_workers=N, worker_init_fn=detctx.seed_worker) with N >= 1; "
            "to seed this process, use detctx.deterministic or detctx.seed_all"
        )
    base_seed = int(info.seed) - worker_id
    # Accelerators are not in this registry, so a worker never touches a device.
    for name, source in registered_sources():
        source.seed(worker_seed(base_seed, worker_id, rank, name))
