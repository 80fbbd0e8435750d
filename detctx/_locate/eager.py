"""Code compiled with ``torch.compile`` runs eagerly while ops are recorded."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, Final

__all__ = ["COMPILE_OFF", "compile_eagerly"]

COMPILE_OFF: Final = "TORCH_COMPILE_DISABLE"
"""What a recording sets while TorchDynamo is not loaded: not part of the environment it
records (the recording runs compiled code eagerly whatever the variable says)."""


def compile_eagerly() -> Callable[[], None]:
    """Have code compiled with ``torch.compile`` run eagerly while recording; what undoes it.

    A recording sees ops one at a time, as eager mode runs them: a compiled graph
    would run fused kernels it cannot see, and TorchDynamo would trace into the
    recorder's own code (torch 2.1 fails in its module hooks, 2.13 in the mode).
    TorchDynamo's ``disable`` switch is set for the recording and put back after;
    not loaded yet (loading it takes a second), it is loaded with the switch on
    through ``$TORCH_COMPILE_DISABLE``, which it reads then.
    """
    config: Any = sys.modules.get("torch._dynamo.config")
    if config is not None:
        before = config.disable
        config.disable = True

        def put_back() -> None:
            config.disable = before

        return put_back
    told = os.environ.get(COMPILE_OFF)
    os.environ[COMPILE_OFF] = "1"

    def restore() -> None:
        if told is None:
            os.environ.pop(COMPILE_OFF, None)
        else:
            os.environ[COMPILE_OFF] = told
        loaded: Any = sys.modules.get("torch._dynamo.config")
        if loaded is not None:  # loaded while recording: as it would have been without
            loaded.disable = told == "1"

    return restore
