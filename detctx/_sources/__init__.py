"""What is managed: the RNG sources. The ``RNGSource`` protocol and its registry, the Python,
torch CPU and NumPy sources, one ``AcceleratorSource`` per device type (through its device
module, never waking an unused device), and each built-in source's checkpoint form with the
checks of every value read back.
"""

from __future__ import annotations

from detctx._sources import checks, plain
from detctx._sources.accelerators import (
    AcceleratorSource,
    Uninitialised,
    active_accelerators,
    device_module,
    register_accelerator,
)
from detctx._sources.checks import InvalidField
from detctx._sources.registry import (
    Checkpointable,
    RNGSource,
    Seeder,
    register_source,
    registered_sources,
    registry_version,
    seeder_of,
    unregister_source,
)

__all__ = [
    "AcceleratorSource",
    "Checkpointable",
    "InvalidField",
    "RNGSource",
    "Seeder",
    "Uninitialised",
    "active_accelerators",
    "checks",
    "device_module",
    "plain",
    "register_accelerator",
    "register_source",
    "registered_sources",
    "registry_version",
    "seeder_of",
    "unregister_source",
]
