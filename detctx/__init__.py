"""detctx: reproducible PyTorch work, scoped to a block, on CPU, CUDA and Ascend NPU.

``with detctx.deterministic(seed=1234):`` seeds every RNG, switches
determinism on and, on exit, restores all of it exactly. The package's
layers are described in ``docs/architecture.md``.

Importing the package imports nothing else: each public name is loaded on
first use (PEP 562), so ``import detctx`` (and the pytest plugin, in a test
session that never uses it) does not import torch or NumPy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detctx._basics import (
        DEFAULT_SEED,
        SEED_ENV,
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
        derive_seed,
        group_seed,
    )
    from detctx._blocks import (
        DeterministicRegion,
        Seeding,
        deterministic,
        deterministic_region,
        open_blocks,
        seed_all,
    )
    from detctx._compare import (
        BitsPart,
        OpError,
        TraceComparison,
        UnpairedOps,
        compare_traces,
        recording,
    )
    from detctx._data import (
        DCPResumeState,
        ElasticLoader,
        dcp_resume_state,
        elastic_loader,
        loader_generator,
        resumable_loader,
        resume,
        resume_state,
        seed_worker,
    )
    from detctx._environment import EnvSwitchOptions
    from detctx._locate import Divergence, locate_divergence
    from detctx._proving import (
        PROBE_OPS,
        Diagnosis,
        ProbeOp,
        ProbeReport,
        ProbeRow,
        check_gradients,
        check_reproducible,
        diagnose,
        run_probe,
    )
    from detctx._sources import RNGSource, register_accelerator, register_source, unregister_source
    from detctx._state import PlainStateSource, Snapshot, capture, fingerprint, restore
    from detctx._switches import SwitchOptions
    from detctx.distributed import (
        DistributedSeeding,
        agree_seed,
        collective_device,
        distributed_deterministic,
        prepare_environment,
        verify_across_ranks,
    )

    # Earlier names, kept working (see _ALIASES).
    Run = Seeding
    DistributedRun = DistributedSeeding
    RNGState = Snapshot

from detctx._version import __version__

# Where each public name lives; tests/test_lazy_imports.py keeps it in step with the
# imports above.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "detctx._sources": (
        "register_accelerator",
        "RNGSource",
        "register_source",
        "unregister_source",
    ),
    "detctx._blocks": (
        "deterministic",
        "open_blocks",
        "seed_all",
        "DeterministicRegion",
        "deterministic_region",
        "Seeding",
    ),
    "detctx._data": (
        "DCPResumeState",
        "dcp_resume_state",
        "ElasticLoader",
        "elastic_loader",
        "loader_generator",
        "seed_worker",
        "resumable_loader",
        "resume",
        "resume_state",
    ),
    "detctx.distributed": (
        "DistributedSeeding",
        "agree_seed",
        "collective_device",
        "distributed_deterministic",
        "prepare_environment",
        "verify_across_ranks",
    ),
    "detctx._basics": (
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
        "DEFAULT_SEED",
        "SEED_ENV",
        "derive_seed",
        "group_seed",
    ),
    "detctx._locate": (
        "Divergence",
        "locate_divergence",
    ),
    "detctx._proving": (
        "Diagnosis",
        "diagnose",
        "PROBE_OPS",
        "ProbeOp",
        "ProbeReport",
        "ProbeRow",
        "run_probe",
        "check_gradients",
        "check_reproducible",
    ),
    "detctx._state": (
        "Snapshot",
        "capture",
        "fingerprint",
        "restore",
        "PlainStateSource",
    ),
    "detctx._compare": (
        "BitsPart",
        "OpError",
        "TraceComparison",
        "UnpairedOps",
        "compare_traces",
        "recording",
    ),
    "detctx._environment": ("EnvSwitchOptions",),
    "detctx._switches": ("SwitchOptions",),
}

# Earlier names, deprecated: they still work, warn with DeprecationWarning naming the new
# name, and are not in __all__. ``Run`` is now ``Seeding`` (what an entry applied; "run" is
# kept for runs of a program), and the RNG-only snapshot that ``capture()`` returns is a
# ``Snapshot`` like every other.
_ALIASES: dict[str, str] = {
    "Run": "Seeding",
    "DistributedRun": "DistributedSeeding",
    "RNGState": "Snapshot",
}
_HOME: dict[str, str] = {name: module for module, names in _EXPORTS.items() for name in names}


__all__ = [
    "DEFAULT_SEED",
    "PROBE_OPS",
    "SEED_ENV",
    "BitsPart",
    "CheckpointError",
    "DCPResumeState",
    "DetctxError",
    "DeterminismUnavailableError",
    "DeterminismWarning",
    "DeterministicRegion",
    "Diagnosis",
    "DistributedSeeding",
    "Divergence",
    "ElasticLoader",
    "EnvSwitchOptions",
    "MetricsError",
    "MissingDependencyError",
    "NotReproducibleError",
    "OpError",
    "OutOfOrderExitError",
    "PlainStateSource",
    "ProbeOp",
    "ProbeReport",
    "ProbeRow",
    "RNGSource",
    "RankDivergenceError",
    "SeedAgreementError",
    "SeedMismatchError",
    "Seeding",
    "Snapshot",
    "SwitchOptions",
    "TraceComparison",
    "TraceError",
    "UndeclaredStreamError",
    "UnpairedOps",
    "__version__",
    "agree_seed",
    "capture",
    "check_gradients",
    "check_reproducible",
    "collective_device",
    "compare_traces",
    "dcp_resume_state",
    "derive_seed",
    "deterministic",
    "deterministic_region",
    "diagnose",
    "distributed_deterministic",
    "elastic_loader",
    "fingerprint",
    "group_seed",
    "loader_generator",
    "locate_divergence",
    "open_blocks",
    "prepare_environment",
    "recording",
    "register_accelerator",
    "register_source",
    "restore",
    "resumable_loader",
    "resume",
    "resume_state",
    "run_probe",
    "seed_all",
    "seed_worker",
    "unregister_source",
    "verify_across_ranks",
]


if not TYPE_CHECKING:
    # Hidden from type checkers, so that a misspelt name is still an error for them.

    def __getattr__(name: str) -> Any:
        """Import the public ``name`` (or the submodule ``detctx.name``) on first use."""
        target = _ALIASES.get(name, name)
        if target != name:
            from detctx._basics import warn_at_user

            warn_at_user(
                f"detctx.{name} is deprecated and will be removed: use detctx.{target}",
                DeprecationWarning,
            )
            # Not cached in the module's globals: every use of the old name warns.
            return getattr(importlib.import_module(_HOME[target]), target)
        module = _HOME.get(target)
        if module is not None:
            value = getattr(importlib.import_module(module), target)
        else:
            try:
                value = importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{name}":
                    raise
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
