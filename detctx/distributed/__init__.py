"""Distributed determinism: one agreed seed on every rank of a ``torch.distributed`` group.

- :mod:`~detctx.distributed.topology`: which device collectives use, rank and size;
- :mod:`~detctx.distributed.agreement`: one ``all_gather`` so that every rank
  knows every rank's seed (:func:`agree_seed`);
- :mod:`~detctx.distributed.verification`: one ``all_gather`` of per-source
  fingerprints (:func:`verify_across_ranks`);
- :mod:`~detctx.distributed.block`: :class:`distributed_deterministic`;
- :mod:`~detctx.distributed.launch`: :func:`prepare_environment` for launchers.

All of it rides on the process group the program already uses (HCCL, NCCL,
gloo); outside a process group nothing is communicated.
"""

from __future__ import annotations

from detctx.distributed.agreement import DistributedSeeding, agree_seed
from detctx.distributed.block import distributed_deterministic
from detctx.distributed.launch import prepare_environment
from detctx.distributed.topology import SUPERPOD_ENV, collective_device
from detctx.distributed.verification import verify_across_ranks

__all__ = [
    "SUPERPOD_ENV",
    "DistributedSeeding",
    "agree_seed",
    "collective_device",
    "distributed_deterministic",
    "prepare_environment",
    "verify_across_ranks",
]
