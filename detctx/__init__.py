"""detctx: reproducible PyTorch work, scoped to a block, on CPU, CUDA and Ascend NPU.

``with detctx.deterministic(seed=1234):`` seeds every RNG, switches
determinism on and, on exit, restores all of it exactly.
"""

from __future__ import annotations

from detctx.accelerators import register_accelerator
from detctx.checkpoint import PlainStateSource
from detctx.context import Run, Snapshot, deterministic, seed_all
from detctx.data import loader_generator, seed_worker
from detctx.distributed import (
    DistributedRun,
    agree_seed,
    collective_device,
    distributed_deterministic,
    group_seed,
    prepare_environment,
    verify_across_ranks,
)
from detctx.errors import (
    CheckpointError,
    DetctxError,
    DeterminismWarning,
    MetricsError,
    MissingDependencyError,
    NotReproducibleError,
    OutOfOrderExitError,
    RankDivergenceError,
    SeedMismatchError,
)
from detctx.seeds import DEFAULT_SEED, SEED_ENV, derive_seed
from detctx.sources import RNGSource, register_source, unregister_source
from detctx.state import RNGState, capture, fingerprint, restore
from detctx.verify import check_gradients, check_reproducible

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SEED",
    "SEED_ENV",
    "CheckpointError",
    "DetctxError",
    "DeterminismWarning",
    "DistributedRun",
    "MetricsError",
    "MissingDependencyError",
    "NotReproducibleError",
    "OutOfOrderExitError",
    "PlainStateSource",
    "RNGSource",
    "RNGState",
    "RankDivergenceError",
    "Run",
    "SeedMismatchError",
    "Snapshot",
    "__version__",
    "agree_seed",
    "capture",
    "check_gradients",
    "check_reproducible",
    "collective_device",
    "derive_seed",
    "deterministic",
    "distributed_deterministic",
    "fingerprint",
    "group_seed",
    "loader_generator",
    "prepare_environment",
    "register_accelerator",
    "register_source",
    "restore",
    "seed_all",
    "seed_worker",
    "unregister_source",
    "verify_across_ranks",
]
