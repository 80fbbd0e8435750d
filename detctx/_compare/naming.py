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

import weakref
from typing import Any

import torch
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from detctx._compare.memory import MemoryTable, memory_key
from detctx._locate import ModuleTracker

__all__ = ["TensorNames"]


def _plain(tensor: Any) -> torch.Tensor | None:
    """The tensor whose memory a name is kept for: a DTensor's shard; ``None`` for another
    subclass (its memory is not the storage it reports)."""
    tensor = getattr(tensor, "_local_tensor", tensor)
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return None
    return tensor


def _memory(tensor: Any) -> int | None:
    plain = _plain(tensor)
    return memory_key(plain) if plain is not None else None


class TensorNames:
    """Installs its hooks on :meth:`start`, removes them on :meth:`stop`."""

    def __init__(self, modules: ModuleTracker) -> None:
        self._modules = modules
        self._names: MemoryTable[str] = MemoryTable()  # a freed memory's name goes with it
        self._handles: list[RemovableHandle] = []
        # What a window's entering state holds: the modules called and the optimizers
        # stepped so far, in the order first seen (weakly: the recording keeps nothing alive).
        self._seen: dict[int, tuple[str, weakref.ref[torch.nn.Module]]] = {}
        self._optimizers: dict[int, weakref.ref[torch.optim.Optimizer]] = {}

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
        self._seen.clear()
        self._optimizers.clear()

    def state(self) -> list[tuple[str, str, torch.Tensor]]:
        """The program's state as the modules called and the optimizers stepped so far hold
        it: ``(module path, name, tensor)`` for each parameter and buffer (in the order the
        modules were first called) and each tensor of an optimizer's state (parameter by
        parameter, entries by name); each memory once (tied weights)."""
        found: list[tuple[str, str, torch.Tensor]] = []
        taken: set[int] = set()

        named: dict[int, str] = {}  # the parameters' names as the modules hold them now

        def take(path: str, name: str, tensor: Any) -> None:
            key = _memory(tensor)
            if key is not None and key not in taken:
                taken.add(key)
                named[key] = name
                found.append((path, name, tensor.detach()))

        for path, held in list(self._seen.values()):
            module = held()
            if module is None:
                continue
            prefix = f"{path}." if path else ""
            for name, parameter in module.named_parameters(recurse=False):
                take(path, f"parameter {prefix}{name}", parameter)
            for name, buffer in module.named_buffers(recurse=False):
                take(path, f"buffer {prefix}{name}", buffer)
        for number, held_optimizer in enumerate(list(self._optimizers.values())):
            optimizer = held_optimizer()
            if optimizer is None:
                continue
            for group in optimizer.param_groups:
                for index, parameter in enumerate(group["params"]):
                    key = _memory(parameter)
                    plain = _plain(parameter)
                    known = (named.get(key) if key is not None else None) or (
                        self._names.of(plain) if plain is not None else None
                    )
                    owner = (
                        known.removeprefix("parameter ")
                        if known
                        else f"optimizer {number} parameter {index}"
                    )
                    entries = optimizer.state.get(parameter, {})
                    for entry in sorted(entries, key=str):
                        if isinstance(entries[entry], torch.Tensor):
                            take("", f"{owner}: {entry}", entries[entry])
        return found

    def name_of(self, outputs: list[torch.Tensor]) -> str | None:
        """The name of the memory the first named output is in, if any."""
        for tensor in outputs:
            plain = _plain(tensor)
            named = self._names.of(plain) if plain is not None else None
            if named is not None:
                return named
        return None

    def _entered(self, module: torch.nn.Module, _args: Any) -> None:
        path = self._modules.current()
        known = self._seen.get(id(module))
        if known is None or known[1]() is not module:
            self._seen[id(module)] = (path, weakref.ref(module))
        for name, parameter in module.named_parameters(recurse=False):
            plain = _plain(parameter)
            if plain is not None:
                self._names.keep(plain, f"parameter {path}.{name}")
        for name, buffer in module.named_buffers(recurse=False):
            plain = _plain(buffer)
            if plain is not None and self._names.of(plain) is None:
                self._names.keep(plain, f"buffer {path}.{name}")

    def _stepping(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        known = self._optimizers.get(id(optimizer))
        if known is None or known() is not optimizer:
            self._optimizers[id(optimizer)] = weakref.ref(optimizer)
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                plain = _plain(parameter)
                named = self._names.of(plain) if plain is not None else None
                if named is None:
                    continue
                for entry, value in optimizer.state.get(parameter, {}).items():
                    state = _plain(value) if isinstance(value, torch.Tensor) else None
                    if state is not None and _memory(state) != _memory(plain):
                        self._names.keep(state, f"{named.removeprefix('parameter ')}: {entry}")
