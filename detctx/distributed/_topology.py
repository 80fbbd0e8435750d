"""Where a process stands in ``torch.distributed``, and one collective to gather rows.

:func:`collective_device` maps a backend to the device its tensors must be on
(CPU for gloo, the current accelerator for NCCL / HCCL / XCCL); the rest are
the small questions the agreement and verification steps ask of the group.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Final

import torch

from detctx._basics import DeterminismWarning, own_work, warn_at_user
from detctx._sources import device_module

__all__ = [
    "SUPERPOD_ENV",
    "all_gather_rows",
    "collective_device",
    "in_process_group",
    "rank_and_size",
    "warn_superpod",
]

SUPERPOD_ENV: Final = "HCCL_LOGIC_SUPERPOD_ID"
"""Set on Ascend clusters whose HCCL collectives cross superpods over RoCE."""

# Backends whose collectives take CPU tensors, and the accelerator backends
# known even where torch.distributed.Backend does not list them (HCCL is
# registered by torch_npu, XCCL only by torch >= 2.7).
_CPU_BACKENDS: Final = frozenset({"gloo", "mpi"})
_ACCELERATOR_BACKENDS: Final = {"nccl": "cuda", "hccl": "npu", "xccl": "xpu"}


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
    elif name in _CPU_BACKENDS or name == "undefined":
        # "undefined": init_process_group() without a backend gives the group torch's
        # default backend for every device type, gloo for CPU among them
        # (torch.distributed.Backend.default_device_backend_map), so CPU tensors work.
        # python -c "import torch.distributed as d; d.init_process_group(store=d.HashStore(),
        #     rank=0, world_size=1); print(d.get_backend())"   # undefined (torch 2.13)
        return torch.device("cpu")
    else:
        device_type = _backend_device_type(name)
    if device_type == "cpu":
        return torch.device("cpu")
    module = device_module(device_type)
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


def in_process_group() -> bool:
    """Whether this process is in an initialised default process group."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size (``ValueError`` if not a member)."""
    dist = torch.distributed
    rank = int(dist.get_rank(group))
    if rank < 0:
        raise ValueError(
            "this process is not a member of the given process group; enter the block "
            "(or call verify_across_ranks) only on the group's ranks"
        )
    return rank, int(dist.get_world_size(group))


def all_gather_rows(row: Sequence[int], group: Any, world_size: int) -> list[list[int]]:
    """Every rank's ``row`` (one int64 tensor each), in group-rank order."""
    dist = torch.distributed
    device = collective_device(str(dist.get_backend(group)))
    with own_work():  # not the program's: a recording skips it
        mine = torch.tensor(list(row), dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine, group=group)
        rows: list[list[int]] = torch.stack(gathered).cpu().tolist()
    return rows


def warn_superpod() -> None:
    """Warn that results depend on the cluster topology when ``HCCL_LOGIC_SUPERPOD_ID`` is set."""
    value = os.environ.get(SUPERPOD_ENV)
    if value:
        warn_at_user(
            f"{SUPERPOD_ENV} is set ({value!r}): over RoCE links, a change of cluster topology "
            f"changes HCCL's collective behaviour, so runs are only reproducible on the same "
            f"topology. Compare runs on the same superpod layout (or unset {SUPERPOD_ENV} "
            f"before launch when the job stays inside one superpod).",
            DeterminismWarning,
        )
