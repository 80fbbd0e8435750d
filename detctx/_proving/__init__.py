"""Proving reproducibility: ``check_reproducible`` / ``check_gradients``, the probe of ops known
to be nondeterministic, and ``diagnose`` behind ``detctx doctor``.
"""

from __future__ import annotations

from detctx._proving.doctor import Diagnosis, diagnose
from detctx._proving.probe import (
    PROBE_OPS,
    SAMPLE_SECONDS,
    TIMED_ROUNDS,
    ProbeOp,
    ProbeReport,
    ProbeRow,
    run_probe,
)
from detctx._proving.reproducible import check_gradients, check_reproducible

__all__ = [
    "PROBE_OPS",
    "SAMPLE_SECONDS",
    "TIMED_ROUNDS",
    "Diagnosis",
    "ProbeOp",
    "ProbeReport",
    "ProbeRow",
    "check_gradients",
    "check_reproducible",
    "diagnose",
    "run_probe",
]
