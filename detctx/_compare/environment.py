"""The environment a trace was recorded in, as one flat table of names to plain values.

Versions (detctx, torch, Python, NumPy, the CUDA torch was built with, CANN), the devices, torch's
thread count, the world size and rank, torch's determinism switches and the
environment variables that steer determinism or collectives. Flat, so two
traces' environments are compared name by name
(:func:`environment_differences`). Read when a recording starts; torch_npu is
read only if the program imported it.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any, Final

import numpy as np
import torch

from detctx._basics import SEED_ENV
from detctx._environment import ENV_SWITCHES
from detctx._locate import COMPILE_OFF

__all__ = ["environment", "environment_differences", "rank_and_world"]

_PREFIXES: Final = (
    "NCCL_",
    "HCCL_",
    "CUBLAS_",
    "CUDNN_",
    "CUDA_LAUNCH_BLOCKING",
    "TORCH_",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "ASCEND_",
    "NVIDIA_TF32",
)
_NAMED: Final = (
    SEED_ENV,
    "TORCHINDUCTOR_DETERMINISTIC",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    *(switch.variable for switch in ENV_SWITCHES),
)
_NOT_COMPARED: Final = frozenset({"rank", "env.RANK", "env.LOCAL_RANK", "env.GROUP_RANK"})
"""Names that differ between the ranks of one run by design."""


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: the process group's, else torchrun's variables."""
    distributed = getattr(torch, "distributed", None)
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank(), distributed.get_world_size()
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1
    return (rank, world) if 0 <= rank < world else (0, 1)


def _devices() -> str:
    names = []
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available():
        names += [cuda.get_device_name(index) for index in range(cuda.device_count())]
    npu = getattr(torch, "npu", None) if "torch_npu" in sys.modules else None
    if npu is not None and npu.is_available():
        names += [npu.get_device_name(index) for index in range(npu.device_count())]
    return ", ".join(names) or f"cpu ({platform.processor() or platform.machine()})"


def _cann() -> str | None:
    module = sys.modules.get("torch_npu")
    version = getattr(getattr(module, "version", None), "cann", None) if module else None
    return str(version) if version else None


def environment() -> dict[str, Any]:
    """The table written in a trace's header."""
    from detctx._version import __version__

    rank, world = rank_and_world()
    backends = torch.backends
    table: dict[str, Any] = {
        "detctx": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        # The CUDA torch was built with (a CPU-only machine has it too); "devices" says
        # what the process had.
        "build.cuda": torch.version.cuda,
        "cann": _cann(),
        "torch_npu": getattr(sys.modules.get("torch_npu"), "__version__", None),
        "devices": _devices(),
        "threads": torch.get_num_threads(),
        "world_size": world,
        "rank": rank,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn.deterministic": bool(backends.cudnn.deterministic),
        "cudnn.benchmark": bool(backends.cudnn.benchmark),
        "cuda.matmul.allow_tf32": bool(backends.cuda.matmul.allow_tf32),
        "cudnn.allow_tf32": bool(backends.cudnn.allow_tf32),
        "mkldnn.enabled": bool(backends.mkldnn.enabled),
    }
    for name, value in sorted(os.environ.items()):
        if (name in _NAMED or name.startswith(_PREFIXES)) and name != COMPILE_OFF:
            table[f"env.{name}"] = value[:1024]
    return table


def environment_differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[Any]]:
    """``name -> [value in a, value in b]`` for every name whose values differ (a name one
    side lacks has ``None`` there); the rank, which differs between ranks by design, is left
    out."""
    return {
        name: [a.get(name), b.get(name)]
        for name in sorted(a.keys() | b.keys())
        if name not in _NOT_COMPARED and a.get(name) != b.get(name)
    }
