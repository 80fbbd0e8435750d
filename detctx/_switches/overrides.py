"""One stack of overrides for a process-wide flag that is changed outside the block lock.

``torch.use_deterministic_algorithms`` is set by blocks and generator worlds
(under the transaction's lock) and by ``deterministic_region`` (on autograd
threads, never under it: a region's backward may run while a block in
another thread holds the lock). When each saved and put back the flag on its
own, a block in one thread and a region in another, overlapping, left the
flag on after both had ended (the "Layers" reproducer in
docs/reliability.md). So every client pushes an :class:`Override` here and
pops it: one that ends while a later one is still in force hands the flags it
found on to that one, and the one that ends last puts back the flags from
before the first, whatever the order in which they end.

A capture is a :class:`Level`: the flags as read, plus the override that was
pushed over it (by a block's entry or a world's swap), so that restoring a
captured level pops exactly that override. A level nothing was pushed over
(a rollback, ``Snapshot.restore``, a world's body between steps) is *put*:
its flags go under the overrides pushed after it was captured, or into the
flag itself when there are none.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Level", "Override", "OverrideStack"]


class Override:
    """One client's setting in force: what it set, and the flags it will put back."""

    __slots__ = ("number", "saved", "setting", "thread")

    def __init__(self, setting: Any, saved: Any, number: int) -> None:
        self.setting = setting
        self.saved = saved
        self.number = number
        self.thread = threading.get_ident()


class Level:
    """Captured flags (compared by value, indexed like the tuple they are) and the
    override pushed over them."""

    __slots__ = ("flags", "number", "override")

    def __init__(self, flags: tuple[Any, ...], number: int) -> None:
        self.flags = flags
        self.number = number
        self.override: Override | None = None

    def __getitem__(self, index: Any) -> Any:
        return self.flags[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Level):
            return self.flags == other.flags
        return self.flags == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Level({self.flags!r})"


class OverrideStack:
    """The overrides in force on one flag, in the order they were pushed.

    ``read()`` returns the flags as a tuple; ``put(flags)`` writes them back;
    ``change(setting, flags found)`` puts a client's setting in force.
    Safe from any thread: each operation holds a lock of its own for a few
    reads and writes of the flag, never while user code runs.
    """

    def __init__(
        self,
        read: Callable[[], tuple[Any, ...]],
        put: Callable[[Any], None],
        change: Callable[[Any, Any], None],
    ) -> None:
        self._read = read
        self._put = put
        self._change = change
        self._overrides: list[Override] = []
        self._lock = threading.RLock()
        self._pushed = 0
        if hasattr(os, "register_at_fork"):  # not on Windows
            os.register_at_fork(after_in_child=self._after_fork_in_child)

    def level(self) -> Level:
        """The flags now, as a level a later :meth:`restore` puts back."""
        return Level(self._read(), self._pushed)

    def push(self, setting: Any, over: Level | None = None) -> Override:
        """Put ``setting`` in force and keep it there until :meth:`pop`.

        ``over``: the level captured just before, which will pop this override when restored.
        If the change raises, the flags are put back and nothing is pushed.
        """
        with self._lock:
            # The flags ``over`` holds were read just before, in the same transaction.
            saved = over.flags if over is not None else self._read()
            try:
                self._change(setting, saved)
            except BaseException:
                self._put(saved)
                raise
            self._pushed += 1
            override = Override(setting, saved, self._pushed)
            self._overrides.append(override)
        if over is not None:
            over.override = override
        return override

    def pop(self, override: Override) -> None:
        """End ``override``: the flags it found go to the next override, or back into the flag.

        Ending one that is no longer in force (popped already, or forgotten) does nothing.
        """
        with self._lock:
            overrides = self._overrides
            for index in range(len(overrides) - 1, -1, -1):
                if overrides[index] is override:
                    break
            else:
                return
            del overrides[index]
            if index < len(overrides):
                overrides[index].saved = override.saved
            else:
                self._put(override.saved)

    def restore(self, level: Level) -> None:
        """Pop the override pushed over ``level``; with none, put its flags back under the
        overrides pushed since it was captured (into the flag when there are none)."""
        override = level.override
        if override is not None:
            level.override = None
            self.pop(override)
            return
        flags = level.flags
        with self._lock:
            for later in self._overrides:
                if later.number > level.number:
                    later.saved = flags
                    return
            self._put(flags)

    def keep(self, level: Level) -> None:
        """Let the override pushed over ``level`` stay in force for good (``seed_all``):
        it leaves the stack without putting anything back."""
        override = level.override
        if override is None:
            return
        level.override = None
        with self._lock:
            if override in self._overrides:
                self._overrides.remove(override)

    def lift(self, override: Override) -> None:
        """Take ``override`` out of force for a while (a suspended generator's block)."""
        self.pop(override)

    def reapply(self, override: Override) -> None:
        """Put a lifted ``override`` back in force, on top, with the flags found now."""
        with self._lock:
            saved = self._read()
            self._change(override.setting, saved)
            self._pushed += 1
            override.saved = saved
            override.number = self._pushed
            override.thread = threading.get_ident()
            self._overrides.append(override)

    def in_force(self) -> int:
        """How many overrides are in force now."""
        return len(self._overrides)

    def _after_fork_in_child(self) -> None:
        # Another thread may have held the lock at fork(); its overrides have no owner
        # left in the child to pop them.
        self._lock = threading.RLock()
        here = threading.get_ident()
        for override in [o for o in reversed(self._overrides) if o.thread != here]:
            self.pop(override)
