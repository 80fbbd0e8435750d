"""What is switched: every determinism switch (flags, and the environment variables of
``detctx._environment``) declared once in ``SWITCHES`` / ``SwitchOptions``, and Ascend's
``npu_level``, applied right after ``algorithms``.
"""

from __future__ import annotations

from detctx._switches.npu_level import describe_npu_level
from detctx._switches.overrides import Level, Override
from detctx._switches.table import (
    ALGORITHMS,
    SWITCHES,
    SwitchOptions,
    default_setting,
    switch_names,
    validate_switches,
)

__all__ = [
    "ALGORITHMS",
    "SWITCHES",
    "Level",
    "Override",
    "SwitchOptions",
    "default_setting",
    "describe_npu_level",
    "switch_names",
    "validate_switches",
]
