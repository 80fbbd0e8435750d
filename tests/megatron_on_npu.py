"""Megatron's RNG tracker on the simulated NPU, reached through ``torch.cuda`` as on Ascend.

MindSpeed imports torch_npu's ``transfer_to_npu``, which copies
``torch.npu``'s public functions over ``torch.cuda``'s (and
``torch.npu.random``'s over ``torch.cuda.random``), and it replaces
Megatron's ``_set_cuda_rng_state`` with a copy that queues its call through
torch_npu's ``_lazy_call`` instead of CUDA's. :func:`install` does the same
with ``tests/simulated_npu.py``, then imports Megatron's tracker module, so
that the real tracker code (``add``, ``fork``, ``model_parallel_cuda_manual_seed``)
runs on the simulated device.

Once per process, like the simulated NPU itself: use it in a subprocess
(``run_python`` in ``conftest.py``). Never use this outside the tests.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, overload

import simulated_npu as sim
import torch

# What torch_npu.npu exports and transfer_to_npu copies onto torch.cuda, as far as
# the simulated device has it.
_REDIRECTED = (
    "is_available",
    "device_count",
    "current_device",
    "set_device",
    "is_initialized",
    "init",
    "get_rng_state",
    "get_rng_state_all",
    "set_rng_state",
    "set_rng_state_all",
    "manual_seed",
    "manual_seed_all",
    "initial_seed",
)


class _DefaultGenerators(Sequence[torch.Generator]):
    """``torch.cuda.default_generators``: the simulated device's, which exist once it is up."""

    @overload
    def __getitem__(self, index: int) -> torch.Generator: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Generator]: ...

    def __getitem__(self, index: Any) -> Any:
        sim._lazy_init()
        return sim.default_generators[index]

    def __len__(self) -> int:
        return sim.device_count()


def install(device_count: int = 1) -> Any:
    """Redirect ``torch.cuda`` to the simulated NPU and return Megatron's tracker module."""
    sim.install(device_count)
    for name in _REDIRECTED:
        function = getattr(sim, name)
        setattr(torch.cuda, name, function)
        if hasattr(torch.cuda.random, name):
            setattr(torch.cuda.random, name, function)
    torch.cuda.default_generators = _DefaultGenerators()  # type: ignore[assignment]
    with warnings.catch_warnings():
        # Megatron warns at import that Transformer Engine and Apex are absent.
        warnings.simplefilter("ignore")
        import megatron.core.tensor_parallel.random as tracker_module
    tracker_module._lazy_call = sim._lazy_call
    return tracker_module


def draw(count: int = 4) -> torch.Tensor:
    """Uniforms from the current simulated device's generator: what dropout there would use."""
    return sim.rand(count, sim.current_device())
