"""Distributed determinism: one agreed seed on every rank of a ``torch.distributed`` group.

- :mod:`~detctx.distributed._topology`: which device collectives use, rank and size;
- :mod:`~detctx.distributed._agreement`: one ``all_gather`` so that every rank
  knows every rank's seed (:func:`agree_seed`), and each rank's own seed
  derived from it (:class:`MegatronSeeds` for Megatron's offsets);
- :mod:`~detctx.distributed._mesh`: seeds over a ``DeviceMesh`` as torchtitan derives
  them (:class:`MeshSeeds`), and DTensor's RNG tracker with the block;
- :mod:`~detctx.distributed._rank_check`: one ``all_gather`` of per-source
  fingerprints (:func:`verify_across_ranks`);
- :mod:`~detctx.distributed._block`: :class:`distributed_deterministic`;
- :mod:`~detctx.distributed._launch`: :func:`prepare_environment` for launchers;
- :mod:`~detctx.distributed._verdict`: one verdict on every rank (:func:`decide_together`),
  for resumes that every rank takes or every rank refuses.

All of it rides on the process group the program already uses (HCCL, NCCL,
gloo); outside a process group nothing is communicated.
"""

from __future__ import annotations

from detctx.distributed._agreement import DistributedSeeding, MegatronSeeds, agree_seed
from detctx.distributed._arrival import DEFAULT_TIMEOUT_S, check_timeout
from detctx.distributed._block import distributed_deterministic
from detctx.distributed._launch import prepare_environment
from detctx.distributed._mesh import MeshSeeds
from detctx.distributed._rank_check import verify_across_ranks
from detctx.distributed._topology import SUPERPOD_ENV, collective_device
from detctx.distributed._verdict import decide_together, run_identity

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SUPERPOD_ENV",
    "DistributedSeeding",
    "MegatronSeeds",
    "MeshSeeds",
    "agree_seed",
    "check_timeout",
    "collective_device",
    "decide_together",
    "distributed_deterministic",
    "prepare_environment",
    "run_identity",
    "verify_across_ranks",
]
