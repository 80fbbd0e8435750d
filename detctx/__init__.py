"""detctx: reproducible PyTorch work, scoped to a block, on CPU, CUDA and Ascend NPU.

``with detctx.deterministic(seed=1234):`` seeds every RNG, switches
determinism on and, on exit, restores all of it exactly.
"""

from __future__ import annotations

from detctx.accelerators import register_accelerator
from detctx.checkpoint import PlainStateSource
from detctx.context import Run, Snapshot, deterministic, seed_all
from detctx.data import loader_generator, seed_worker
from detctx.errors import (
    CheckpointError,
    DetctxError,
    DeterminismWarning,
    MetricsError,
    MissingDependencyError,
    NotReproducibleError,
    OutOfOrderExitError,
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
    "MetricsError",
    "MissingDependencyError",
    "NotReproducibleError",
    "OutOfOrderExitError",
    "PlainStateSource",
    "RNGSource",
    "RNGState",
    "Run",
    "Snapshot",
    "__version__",
    "capture",
    "check_gradients",
    "check_reproducible",
    "derive_seed",
    "deterministic",
    "fingerprint",
    "loader_generator",
    "register_accelerator",
    "register_source",
    "restore",
    "seed_all",
    "seed_worker",
    "unregister_source",
]
