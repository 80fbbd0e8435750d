"""Names for the tensors an op outside every module writes: the parameter an optimizer
updates (``GPT.h.0.attn.c_attn.bias``), the optimizer state it keeps for one
(``GPT.h.0.attn.c_attn.bias: exp_avg``).

Every op of ``Optimizer.step`` runs outside any module, at the line that
called ``step()``, so its module path and source line say nothing of which
parameter it updates. A forward pre-hook names each running module's own
parameters by the module's path (as :class:`~detctx._locate.ModuleTracker`
gives it, read again at every entry: FSDP2 and ``param.data = ...`` replace
their memory), and an optimizer step pre-hook names each parameter's state
tensors after it; an op's name is the one its written memory has.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from detctx._locate import ModuleTracker

__all__ = ["TensorNames"]


def _memory(tensor: Any) -> int | None:
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return None  # a DTensor or another subclass: its local shard is not this memory
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return pointer or None


class TensorNames:
    """Installs its hooks on :meth:`start`, removes them on :meth:`stop`."""

    def __init__(self, modules: ModuleTracker) -> None:
        self._modules = modules
        self._names: dict[int, str] = {}
        self._handles: list[RemovableHandle] = []

    def start(self) -> None:
        # After the tracker's own pre-hook (registered first), so its path is this module's.
        self._handles.append(module_hooks.register_module_forward_pre_hook(self._entered))
        from torch.optim import optimizer  # torch.optim's submodule, not its attribute

        step_hook = getattr(optimizer, "register_optimizer_step_pre_hook", None)
        if step_hook is not None:
            self._handles.append(step_hook(self._stepping))

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._names.clear()

    def name_of(self, outputs: list[torch.Tensor]) -> str | None:
        """The name of the memory the first named output is in, if any."""
        for tensor in outputs:
            key = _memory(tensor)
            if key is not None and key in self._names:
                return self._names[key]
        return None

    def _entered(self, module: torch.nn.Module, _args: Any) -> None:
        path = self._modules.current()
        for name, parameter in module.named_parameters(recurse=False):
            key = _memory(parameter)
            if key is not None:
                self._names[key] = f"parameter {path}.{name}"

    def _stepping(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                key = _memory(parameter)
                named = self._names.get(key) if key is not None else None
                if named is None:
                    continue
                for entry, value in optimizer.state.get(parameter, {}).items():
                    state_key = _memory(value) if isinstance(value, torch.Tensor) else None
                    if state_key is not None and state_key != key:
                        self._names[state_key] = f"{named.removeprefix('parameter ')}: {entry}"
