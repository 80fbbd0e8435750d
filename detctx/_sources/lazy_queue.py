"""A device module's private lazy queue: where it stood, what one call added, rewinding it.

``torch.cuda`` and ``torch.xpu`` queue calls made before the device is
initialised (``_queued_calls``, plus a ``_lazy_seed_tracker`` that keeps only
the last seed call); torch_npu has the queue without the tracker, and appends
every call. Neither is public API, so every use checks what it finds and says
when it cannot tell (see :mod:`detctx._sources.accelerators`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["QueueMark", "QueuedEntry"]


@dataclass(frozen=True)
class QueueMark:
    """Where a device module's private lazy queue stood at one moment."""

    calls: list[Any]
    length: int
    last: object
    tracker: Any
    tracker_fields: dict[str, Any] | None

    @classmethod
    def take(cls, module: Any) -> QueueMark | None:
        calls = getattr(module, "_queued_calls", None)
        if not isinstance(calls, list):
            return None
        tracker = getattr(module, "_lazy_seed_tracker", None)
        fields = None
        if tracker is not None:
            fields = {k: list(v) if isinstance(v, list) else v for k, v in vars(tracker).items()}
        return cls(calls, len(calls), calls[-1] if calls else None, tracker, fields)

    def same_as(self, other: QueueMark | None) -> bool:
        """Whether nothing was queued between the two marks."""
        if other is None or other.calls is not self.calls or other.length != self.length:
            return False
        if other.last is not self.last:
            return False
        if self.tracker_fields is None or other.tracker_fields is None:
            return self.tracker_fields is other.tracker_fields
        return all(
            other.tracker_fields.get(k) is v or other.tracker_fields.get(k) == v
            for k, v in self.tracker_fields.items()
        )

    def added_by(self, later: QueueMark) -> QueuedEntry | None:
        """What one lazy call added between this mark and ``later``, if it can be told."""
        if later.calls is not self.calls or not self._prefix_intact():
            return None
        appended = tuple(later.calls[self.length : later.length])
        seed_all = None
        if later.tracker_fields is not None and self.tracker_fields is not None:
            seed_all = later.tracker_fields.get("manual_seed_all_cb")
            if seed_all is self.tracker_fields.get("manual_seed_all_cb"):
                seed_all = None
        if not appended and seed_all is None:
            return None
        return QueuedEntry(appended, seed_all)

    def _prefix_intact(self) -> bool:
        """Whether the queue still holds what it held at this mark (maybe more after it)."""
        calls, length = self.calls, self.length
        return len(calls) >= length and (not length or calls[length - 1] is self.last)

    def append(self, entry: QueuedEntry) -> bool:
        """Re-queue what one earlier lazy call queued; False if that cannot be done."""
        queue_seed_all = getattr(self.tracker, "queue_seed_all", None)
        if entry.seed_all is not None and queue_seed_all is None:
            return False
        self.calls.extend(entry.appended)
        if entry.seed_all is not None and queue_seed_all is not None:
            queue_seed_all(*entry.seed_all)
        return True

    def rewind(self) -> bool:
        """Drop everything queued since this mark; False if the queue's past changed."""
        if not self._prefix_intact():
            return False
        del self.calls[self.length :]
        if self.tracker is not None and self.tracker_fields is not None:
            for key, value in self.tracker_fields.items():
                setattr(self.tracker, key, list(value) if isinstance(value, list) else value)
        return True


@dataclass(frozen=True)
class QueuedEntry:
    """The queue entries one lazy ``manual_seed_all`` call made."""

    appended: tuple[Any, ...]
    seed_all: Any
