"""detctx: reproducible PyTorch work, scoped to a block, on CPU, CUDA and Ascend NPU.

``with detctx.deterministic(seed=1234):`` seeds every RNG, switches
determinism on and, on exit, restores all of it exactly. The package's
layers are described in ``docs/architecture.md``.
"""

from __future__ import annotations

from detctx.accelerators import register_accelerator
from detctx.context import deterministic, open_blocks, seed_all
from detctx.data import loader_generator, seed_worker
from detctx.distributed import (
    DistributedSeeding,
    agree_seed,
    collective_device,
    distributed_deterministic,
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
    SeedAgreementError,
    SeedMismatchError,
)
from detctx.seeds import DEFAULT_SEED, SEED_ENV, derive_seed, group_seed
from detctx.settings import Seeding
from detctx.snapshot import Snapshot, capture, fingerprint, restore
from detctx.sources import RNGSource, register_source, unregister_source
from detctx.state_dict import PlainStateSource
from detctx.switches import EnvSwitchOptions, SwitchOptions
from detctx.verify import check_gradients, check_reproducible

__version__ = "0.1.0"

# Earlier names, kept working: ``Run`` is now ``Seeding`` (what an entry applied;
# "run" is kept for runs of a program), and the RNG-only snapshot that
# ``capture()`` returns is a ``Snapshot`` like every other.
Run = Seeding
DistributedRun = DistributedSeeding
RNGState = Snapshot

__all__ = [
    "DEFAULT_SEED",
    "SEED_ENV",
    "CheckpointError",
    "DetctxError",
    "DeterminismWarning",
    "DistributedRun",
    "DistributedSeeding",
    "EnvSwitchOptions",
    "MetricsError",
    "MissingDependencyError",
    "NotReproducibleError",
    "OutOfOrderExitError",
    "PlainStateSource",
    "RNGSource",
    "RNGState",
    "RankDivergenceError",
    "Run",
    "SeedAgreementError",
    "SeedMismatchError",
    "Seeding",
    "Snapshot",
    "SwitchOptions",
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
    "open_blocks",
    "prepare_environment",
    "register_accelerator",
    "register_source",
    "restore",
    "seed_all",
    "seed_worker",
    "unregister_source",
    "verify_across_ranks",
]
