"""The environment: ``os.environ`` read and written without per-call encoding, the *watched*
variables frameworks export, every environment-variable switch (``EnvSwitchOptions``), and
inductor's ``deterministic`` followed without importing inductor. Nothing here imports torch:
``detctx run`` reads these in its parent process.
"""

from __future__ import annotations

from detctx._environment import inductor
from detctx._environment.switches import ENV_SWITCHES, EnvSwitch, EnvSwitchOptions, env_switches
from detctx._environment.variables import WATCHED, WatchedVariables, getenv, setenv

__all__ = [
    "ENV_SWITCHES",
    "WATCHED",
    "EnvSwitch",
    "EnvSwitchOptions",
    "WatchedVariables",
    "env_switches",
    "getenv",
    "inductor",
    "setenv",
]
