"""Which recorded op last wrote each memory (the data flow's table), or what else is known
of it (a parameter's name): keyed by the memory a tensor's storage holds, each entry
forgotten once that storage is freed.

A storage's address is reused once it is freed, by whatever the allocator hands it to next;
memory handed out by a path the recorder does not see (``torch.tensor(0.0)``, a
constant AdamW keeps as its step) would otherwise inherit the producer of whatever was
there before, and two runs of one program, whose allocations fall differently, would
read different data flows. Each entry holds a weak reference to its storage and counts
only while it lives.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch

__all__ = ["MemoryTable", "Producers", "memory_key"]

Producer = tuple[int, int]
"""The op and output that wrote a memory."""
T = TypeVar("T")


def memory_key(tensor: torch.Tensor) -> int | None:
    """The address of the memory ``tensor``'s storage holds, or ``None`` (no storage)."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    return pointer or None


def _weak(tensor: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(tensor.untyped_storage())  # type: ignore[no-untyped-call]
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def _holds(weak: Any, key: int) -> bool:
    """Whether the storage ``weak`` refers to lives and still holds the memory at ``key``
    (FSDP2 frees a parameter's memory by resizing its storage to 0, and allocates it
    again elsewhere)."""
    if weak is None or weak.expired():
        return False
    try:
        return bool(torch.UntypedStorage._new_with_weak_ptr(weak.cdata).data_ptr() == key)
    except (RuntimeError, AttributeError, TypeError):
        return True  # no way to look: the storage lives, its memory is taken as kept


class MemoryTable(Generic[T]):
    """Memory address -> what is known of the memory there, while its storage lives."""

    def __init__(self) -> None:
        self._table: dict[int, tuple[T, Any]] = {}

    def of(self, tensor: torch.Tensor) -> T | None:
        """What is known of the memory ``tensor`` is in (``None``: nothing, or it was freed
        and the address handed out again)."""
        key = memory_key(tensor)
        found = self._table.get(key) if key is not None else None
        if found is None:
            return None
        if not _holds(found[1], key):  # type: ignore[arg-type]
            del self._table[key]  # type: ignore[arg-type]
            return None
        return found[0]

    def keep(self, tensor: torch.Tensor, known: T) -> None:
        key = memory_key(tensor)
        if key is not None:
            self._table[key] = (known, _weak(tensor))

    def forget(self, tensor: torch.Tensor) -> None:
        key = memory_key(tensor)
        if key is not None:
            self._table.pop(key, None)

    def clear(self) -> None:
        self._table.clear()


class Producers(MemoryTable[Producer]):
    """Memory address -> the op and output that last wrote it, while its storage lives."""

    def writer_of(self, tensor: torch.Tensor) -> Producer | None:
        return self.of(tensor)

    def wrote(self, tensor: torch.Tensor, producer: Producer) -> None:
        self.keep(tensor, producer)
