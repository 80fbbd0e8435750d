"""The alternatives detctx is measured against, written the way users write them.

``floor_block`` is the floor: the raw get/set/seed calls a full block cannot
avoid (Python, NumPy and torch CPU states; the algorithm and cuDNN flags; the
environment variables), with nothing around them. ``hand_written_block`` is
what a careful user writes today: the same, but through ``torch.manual_seed``
and ``torch.get_rng_state``, as MindSpeed and most scripts do.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

SEED = 1234

# The values a block writes, in the core's order (PYTHONHASHSEED first).
ENV_VALUES = {
    "PYTHONHASHSEED": str(SEED),
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "HCCL_DETERMINISTIC": "true",
    "CLOSE_MATMUL_K_SHIFT": "1",
    "FLASH_ATTENTION_DETERMINISTIC": "1",
}

_cudnn = torch.backends.cudnn
_environ = os.environ
_generator = torch.default_generator


def raw_capture() -> tuple[Any, Any, Any]:
    """Python, NumPy global and torch CPU states, through the raw calls."""
    return random.getstate(), np.random.get_state(), _generator.get_state()


def raw_restore(states: tuple[Any, Any, Any]) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    _generator.set_state(states[2])


def _restore_env(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            _environ.pop(name, None)
        else:
            _environ[name] = value


def floor_block(body: Callable[[], object] = lambda: None) -> None:
    """The raw calls a full block needs and nothing else."""
    py, npy, tch = random.getstate(), np.random.get_state(), _generator.get_state()
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        _cudnn.deterministic,
        _cudnn.benchmark,
    )
    env = {name: _environ.get(name) for name in ENV_VALUES}
    random.seed(SEED)
    np.random.seed(SEED)
    _generator.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    _cudnn.deterministic = True
    _cudnn.benchmark = False
    _environ.update(ENV_VALUES)
    body()
    random.setstate(py)
    np.random.set_state(npy)
    _generator.set_state(tch)
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    _cudnn.deterministic, _cudnn.benchmark = flags[2], flags[3]
    _restore_env(env)


def mindspeed_seed_all() -> None:
    """MindSpeed's sequence: the three seeds, the hash seed, the flags and the env vars."""
    random.seed(SEED)
    os.environ["PYTHONHASHSEED"] = str(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    for name, value in ENV_VALUES.items():
        os.environ[name] = value


def hand_written_block(body: Callable[[], object] = lambda: None) -> None:
    """Save three states; ``random.seed``, ``np.random.seed``, ``torch.manual_seed``;
    flags and environment; restore everything in ``finally``."""
    py, npy, tch = random.getstate(), np.random.get_state(), torch.get_rng_state()
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    env = {name: os.environ.get(name) for name in ENV_VALUES}
    try:
        mindspeed_seed_all()
        body()
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(tch)
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2:]
        _restore_env(env)


def fork_rng_block(body: Callable[[], object] = lambda: None) -> None:
    """``torch.random.fork_rng`` + ``torch.manual_seed``: torch CPU only, no flags or env."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        body()


def lightning_block() -> tuple[Callable[[], None] | None, str]:
    """Lightning's ``isolate_rng`` + ``seed_everything`` (no flags, no env), if installed."""
    try:
        from lightning.fabric.utilities.seed import seed_everything
        from lightning.pytorch.utilities.seed import isolate_rng

        where = "lightning"
    except ImportError:
        try:
            from lightning_fabric.utilities.seed import seed_everything
            from pytorch_lightning.utilities.seed import isolate_rng

            where = "pytorch_lightning"
        except ImportError:
            return None, "not installed (lightning / pytorch_lightning)"

    def block() -> None:
        with isolate_rng():
            seed_everything(SEED, verbose=False)

    return block, where


def floor_parts() -> dict[str, Callable[[], None]]:
    """The floor, split by what it touches, to show which raw call dominates."""
    env_names = list(ENV_VALUES)

    def python_part() -> None:
        state = random.getstate()
        random.seed(SEED)
        random.setstate(state)

    def numpy_part() -> None:
        state = np.random.get_state()
        np.random.seed(SEED)
        np.random.set_state(state)

    def torch_part() -> None:
        state = _generator.get_state()
        _generator.manual_seed(SEED)
        _generator.set_state(state)

    def flags_part() -> None:
        saved = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            _cudnn.deterministic,
            _cudnn.benchmark,
        )
        torch.use_deterministic_algorithms(True)
        _cudnn.deterministic = True
        _cudnn.benchmark = False
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        _cudnn.deterministic, _cudnn.benchmark = saved[2], saved[3]

    def env_part() -> None:
        saved = {name: _environ.get(name) for name in env_names}
        _environ.update(ENV_VALUES)
        _restore_env(saved)

    return {
        "python getstate+seed+setstate": python_part,
        "numpy get_state+seed+set_state": numpy_part,
        "torch CPU get+manual_seed+set": torch_part,
        "flags read+on+off": flags_part,
        "5 env vars read+set+restore": env_part,
    }
