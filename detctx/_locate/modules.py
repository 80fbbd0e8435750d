"""The path of the innermost ``nn.Module`` running now, without being handed the model.

Global forward pre- and post-hooks keep a per-thread stack of running
modules. A module entered with nothing running (or that is no submodule of
the running one's root) is a root: it is named by its class, and its
submodules by ``named_modules()``, so an op inside ``model.encoder.layers[3]``
of a ``Net`` reads ``Net.encoder.layers.3``. A module that is no registered
submodule of its root (made on the fly) is named by its class after its
caller's path.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

__all__ = ["ModuleTracker"]


class _Stack(threading.local):
    def __init__(self) -> None:
        self.entries: list[tuple[torch.nn.Module, str, dict[int, str]]] = []


class ModuleTracker:
    """Installs the global hooks on :meth:`start`, removes them on :meth:`stop`."""

    def __init__(self) -> None:
        self._stack = _Stack()
        self._handles: list[RemovableHandle] = []

    def start(self) -> None:
        if self._handles:
            return
        self._handles.append(module_hooks.register_module_forward_pre_hook(self._enter))
        try:
            # always_call (torch 2.1+) pops the stack when a forward raises, too.
            handle = module_hooks.register_module_forward_hook(self._leave, always_call=True)
        except TypeError:
            handle = module_hooks.register_module_forward_hook(self._leave)
        self._handles.append(handle)

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.entries.clear()

    def current(self) -> str:
        """The dotted path of the innermost running module, ``""`` when none runs."""
        entries = self._stack.entries
        return entries[-1][1] if entries else ""

    def _enter(self, module: torch.nn.Module, _args: Any) -> None:
        entries = self._stack.entries
        if entries:
            _, parent_path, names = entries[-1]
            name = names.get(id(module))
            if name is not None:
                entries.append((module, name, names))
                return
            entries.append((module, f"{parent_path}.{type(module).__name__}", names))
            return
        root = type(module).__name__
        names = {
            id(sub): f"{root}.{sub_name}" if sub_name else root
            for sub_name, sub in module.named_modules()
        }
        entries.append((module, root, names))

    def _leave(self, module: torch.nn.Module, _args: Any, _output: Any) -> None:
        entries = self._stack.entries
        for position in range(len(entries) - 1, -1, -1):
            if entries[position][0] is module:
                del entries[position:]
                return
