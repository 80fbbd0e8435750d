"""detctx: reproducible PyTorch work, scoped to a block, on CPU, CUDA and Ascend NPU.

``with detctx.deterministic(seed=1234):`` seeds every RNG, switches
determinism on and, on exit, restores all of it exactly.
"""

from __future__ import annotations

from detctx.accelerators import register_accelerator
from detctx.context import Run, Snapshot, deterministic, seed_all
from detctx.errors import DetctxError, DeterminismWarning, OutOfOrderExitError
from detctx.seeds import DEFAULT_SEED, SEED_ENV, derive_seed
from detctx.sources import RNGSource, register_source, unregister_source
from detctx.state import RNGState, capture, fingerprint

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SEED",
    "SEED_ENV",
    "DetctxError",
    "DeterminismWarning",
    "OutOfOrderExitError",
    "RNGSource",
    "RNGState",
    "Run",
    "Snapshot",
    "__version__",
    "capture",
    "derive_seed",
    "deterministic",
    "fingerprint",
    "register_accelerator",
    "register_source",
    "seed_all",
    "unregister_source",
]
