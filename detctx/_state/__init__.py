"""Process state as values and the one transaction that changes it: signals held off across a
change, the lock, capture, change, rollback; ``Snapshot`` (RNG states and switch values by
name), its canonical bytes and its checkpoint form.
"""

from __future__ import annotations

from detctx._state import interrupts, transaction
from detctx._state.snapshot import (
    Snapshot,
    active_sources,
    capture,
    fingerprint,
    restore,
    restore_sources,
)
from detctx._state.state_dict import PlainStateSource
from detctx._state.values import canonical_bytes, device_state_seed

__all__ = [
    "PlainStateSource",
    "Snapshot",
    "active_sources",
    "canonical_bytes",
    "capture",
    "device_state_seed",
    "fingerprint",
    "interrupts",
    "restore",
    "restore_sources",
    "transaction",
]
