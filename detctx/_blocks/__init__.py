"""The user's objects: ``Settings`` (one validated configuration), the stack of open blocks,
``deterministic`` / ``seed_all`` and every decorator form, ``deterministic_region``.
"""

from __future__ import annotations

from detctx._blocks import stack
from detctx._blocks.block import deterministic, open_blocks, seed_all
from detctx._blocks.decorators import Block, decorate, is_hypothesis_test
from detctx._blocks.region import DeterministicRegion, deterministic_region
from detctx._blocks.settings import Seeding, Settings

__all__ = [
    "Block",
    "DeterministicRegion",
    "Seeding",
    "Settings",
    "decorate",
    "deterministic",
    "deterministic_region",
    "is_hypothesis_test",
    "open_blocks",
    "seed_all",
    "stack",
]
