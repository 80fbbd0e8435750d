"""A simulated Ascend NPU: a test double for hardware these machines lack.

It is a device module backed by CPU ``torch.Generator`` objects, registered
exactly the way torch_npu registers itself
(``torch.utils.rename_privateuse1_backend("npu")`` and
``torch._register_device_module("npu", module)``), with torch_npu's RNG
functions and its lazy-initialisation behaviour: before the device is
initialised, ``manual_seed*`` and ``set_rng_state`` are appended to
``_queued_calls`` (with a formatted stack trace each) and run at
initialisation; ``get_rng_state`` and ``initial_seed`` initialise the device.
``install(levels=True)`` adds torch_npu's determinism levels
(``set_deterministic_level`` / ``_get_deterministic_level``, one level per
process, kept in step with ``torch.use_deterministic_algorithms`` and warning
as torch_npu does); without it the module is an older torch_npu that lacks them.

The registration can happen once per process, so tests that use it run it in
a subprocess (see ``run_python`` in ``conftest.py``). Never use
this outside the tests.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

_DEFAULT_SEED = 67280421310721  # c10's default_rng_seed_val, as on a real device

_device_count = 0
_initialized = False
_queued_calls: list[tuple[Callable[[], None], list[str]]] = []
default_generators: tuple[torch.Generator, ...] = ()
_current = 0
init_count = 0  # how many times the device was initialised (tests assert on it)


_lazy_seed_tracker: Any = None


def install(
    device_count: int = 2, *, seed_tracker: bool = False, levels: bool = False, max_level: int = 3
) -> None:
    """Register this module as ``torch.npu``, with ``device_count`` devices.

    ``seed_tracker=True`` queues ``manual_seed*`` the way torch.cuda and
    torch.xpu do (a tracker keeping only the latest seed, run after the other
    queued calls) instead of torch_npu's plain list. ``levels=True`` adds
    ``set_deterministic_level`` / ``_get_deterministic_level``; a level above
    ``max_level`` raises, as torch_npu does where the runtime lacks it.
    """
    global _device_count, _lazy_seed_tracker, _max_level
    _device_count = device_count
    _max_level = max_level
    if levels:
        module = sys.modules[__name__]
        module.set_deterministic_level = _set_deterministic_level  # type: ignore[attr-defined]
        module._get_deterministic_level = _get_deterministic_level  # type: ignore[attr-defined]
    if seed_tracker:
        from torch._utils import _LazySeedTracker

        _lazy_seed_tracker = _LazySeedTracker()
    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", sys.modules[__name__])


def is_available() -> bool:
    return _device_count > 0


def device_count() -> int:
    return _device_count


def current_device() -> int:
    return _current


def set_device(index: int) -> None:
    global _current
    _current = index


def is_initialized() -> bool:
    return _initialized


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    global _initialized, default_generators, init_count
    if _initialized:
        return
    default_generators = tuple(
        torch.Generator().manual_seed(_DEFAULT_SEED) for _ in range(_device_count)
    )
    _initialized = True
    init_count += 1
    calls = list(_queued_calls)
    if _lazy_seed_tracker is not None:
        calls.extend(call for call in _lazy_seed_tracker.get_calls() if call)
    _queued_calls.clear()
    for call, _trace in calls:
        call()


init = _lazy_init


def _lazy_call(callable: Callable[[], None], seed_all: bool = False) -> None:
    if _initialized:
        callable()
    elif seed_all and _lazy_seed_tracker is not None:
        _lazy_seed_tracker.queue_seed_all(callable, traceback.format_stack())
    else:
        _queued_calls.append((callable, traceback.format_stack()))


def _index(device: Any) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return _current if device.index is None else device.index


def get_rng_state(device: Any = "npu") -> torch.Tensor:
    _lazy_init()
    return default_generators[_index(device)].get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(_device_count)]


def set_rng_state(new_state: torch.Tensor, device: Any = "npu") -> None:
    new_state = new_state.clone()
    index = _index(device)
    _lazy_call(lambda: default_generators[index].set_state(new_state))


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)


def manual_seed(seed: int) -> None:
    seed = int(seed)
    _lazy_call(lambda: default_generators[_current].manual_seed(seed))


def manual_seed_all(seed: int) -> None:
    seed = int(seed)

    def cb() -> None:
        for generator in default_generators:
            generator.manual_seed(seed)

    _lazy_call(cb, seed_all=True)


def initial_seed() -> int:
    _lazy_init()
    return int(default_generators[_current].initial_seed())


def rand(n: int, device: int = 0) -> torch.Tensor:
    """Draw ``n`` uniforms on simulated device ``device`` (initialising it)."""
    _lazy_init()
    return torch.rand(n, generator=default_generators[device])


_level = 0  # torch_npu keeps the level per process, in C++
_max_level = 3
level_calls = 0  # how many times the level was set (tests assert on it)


def _set_deterministic_level(level: int) -> None:
    global _level, level_calls
    if not 0 <= level <= _max_level:
        raise RuntimeError(f"deterministic level {level} is not supported by this runtime")
    enabled = torch.are_deterministic_algorithms_enabled()
    if level == 0 and enabled:
        warnings.warn(
            "The current configuration value of 'torch_npu.npu.set_deterministic_level' "
            "conflicts with 'torch.use_deterministic_algorithms'. "
            "'torch.use_deterministic_algorithms' has been configured to 'False'.",
            stacklevel=2,
        )
        torch.use_deterministic_algorithms(False)
    elif level >= 1 and not enabled:
        warnings.warn(
            "The current configuration value of 'torch_npu.npu.set_deterministic_level' "
            "conflicts with 'torch.use_deterministic_algorithms'. "
            "'torch.use_deterministic_algorithms' has been configured to 'True'.",
            stacklevel=2,
        )
        torch.use_deterministic_algorithms(True)
    _level = level
    level_calls += 1
    warnings.warn(
        "After using 'torch_npu.npu.set_deterministic_level', please do not use "
        "'torch.use_deterministic_algorithms' anymore, as it may cause unknown errors.",
        stacklevel=2,
    )


def _get_deterministic_level() -> int:
    global _level
    enabled = torch.are_deterministic_algorithms_enabled()
    if _level == 0 and enabled:
        _level = 1
    elif _level >= 1 and not enabled:
        _level = 0
    return _level
