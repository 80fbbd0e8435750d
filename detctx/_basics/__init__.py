"""The basics every layer uses: the exception classes, seeds (validation, the one seed-text
parser, ``$DETCTX_SEED``, every derivation of one seed from another), the one rule for
"the same float", the one walker over nested values, the reset seam of process-wide caches
and warnings that point at the user's line. Nothing here imports torch or NumPy at import
time.
"""

from __future__ import annotations

from detctx._basics import nested
from detctx._basics.caches import process_cache, reset_caches
from detctx._basics.envelope import open_envelope, plain_digest, same_plain
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
from detctx._basics.portable_option import (
    MAX_PORTABLE_SEED,
    PORTABLE_ENV,
    parse_portable,
    portable_seed,
    portable_text,
)
from detctx._basics.run_notes import NOTES_ENV, EntryNote, note_entry, read_entry_note
from detctx._basics.scratch import (
    SCRATCH_LOCK,
    SCRATCH_PREFIX,
    Scratch,
    scratch_folder,
    sweep_scratch,
)
from detctx._basics.seeds import (
    CAUSES_OF_A_DIFFERENT_START,
    DEFAULT_SEED,
    MAX_SEED,
    SEED_ENV,
    as_integer,
    content_seed,
    derive_seed,
    group_seed,
    indexed_seed,
    indexed_seeds,
    indexed_words,
    loader_seed,
    megatron_stage_seed,
    megatron_tracker_seeds,
    mesh_seed,
    node_seed,
    parse_seed,
    resolve_seed,
    stream_keys,
    validate_seed,
    worker_seed,
)
from detctx._basics.steps import STEPS_ENV, parse_steps, steps_text
from detctx._basics.unrecorded import doing_own_work, own_work
from detctx._basics.user_warnings import warn_at_user

__all__ = [
    "CAUSES_OF_A_DIFFERENT_START",
    "DEFAULT_SEED",
    "MAX_PORTABLE_SEED",
    "MAX_SEED",
    "NOTES_ENV",
    "PORTABLE_ENV",
    "SCRATCH_LOCK",
    "SCRATCH_PREFIX",
    "SEED_ENV",
    "STEPS_ENV",
    "CheckpointError",
    "DetctxError",
    "DeterminismUnavailableError",
    "DeterminismWarning",
    "EntryNote",
    "MetricsError",
    "MissingDependencyError",
    "NotReproducibleError",
    "OutOfOrderExitError",
    "RankDivergenceError",
    "Scratch",
    "SeedAgreementError",
    "SeedMismatchError",
    "TraceError",
    "UndeclaredStreamError",
    "as_integer",
    "content_seed",
    "derive_seed",
    "doing_own_work",
    "group_seed",
    "indexed_seed",
    "indexed_seeds",
    "indexed_words",
    "loader_seed",
    "megatron_stage_seed",
    "megatron_tracker_seeds",
    "mesh_seed",
    "nested",
    "node_seed",
    "note_entry",
    "open_envelope",
    "own_work",
    "parse_portable",
    "parse_seed",
    "parse_steps",
    "plain_digest",
    "portable_seed",
    "portable_text",
    "process_cache",
    "read_entry_note",
    "reset_caches",
    "resolve_seed",
    "same_float",
    "same_plain",
    "scratch_folder",
    "steps_text",
    "stream_keys",
    "sweep_scratch",
    "validate_seed",
    "warn_at_user",
    "worker_seed",
]
