"""The basics every layer uses: the exception classes, seeds (validation, the one seed-text
parser, ``$DETCTX_SEED``, every derivation of one seed from another) and the one rule for
"the same float". Nothing here imports torch or NumPy at import time.
"""

from __future__ import annotations

from detctx._basics.equality import same_float
from detctx._basics.errors import (
    CheckpointError,
    DetctxError,
    DeterminismUnavailableError,
    DeterminismWarning,
    MetricsError,
    MissingDependencyError,
    NotReproducibleError,
    OutOfOrderExitError,
    RankDivergenceError,
    SeedAgreementError,
    SeedMismatchError,
    TraceError,
    UndeclaredStreamError,
)
from detctx._basics.seeds import (
    CAUSES_OF_A_DIFFERENT_START,
    DEFAULT_SEED,
    MAX_SEED,
    SEED_ENV,
    as_integer,
    derive_seed,
    group_seed,
    indexed_seeds,
    parse_seed,
    resolve_seed,
    validate_seed,
)

__all__ = [
    "CAUSES_OF_A_DIFFERENT_START",
    "DEFAULT_SEED",
    "MAX_SEED",
    "SEED_ENV",
    "CheckpointError",
    "DetctxError",
    "DeterminismUnavailableError",
    "DeterminismWarning",
    "MetricsError",
    "MissingDependencyError",
    "NotReproducibleError",
    "OutOfOrderExitError",
    "RankDivergenceError",
    "SeedAgreementError",
    "SeedMismatchError",
    "TraceError",
    "UndeclaredStreamError",
    "as_integer",
    "derive_seed",
    "group_seed",
    "indexed_seeds",
    "parse_seed",
    "resolve_seed",
    "same_float",
    "validate_seed",
]
