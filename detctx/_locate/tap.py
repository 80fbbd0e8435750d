"""The one op recorder's base: a ``TorchDispatchMode`` hands every op to it.

The mode lives in ``torch.utils._python_dispatch``, a private torch module,
so it is looked up when recording starts and a missing one is reported as
:class:`~detctx.MissingDependencyError` rather than a crash. :class:`Recorder`
is what ``locate_divergence`` / ``detctx run --locate``
(:class:`~detctx._locate.recorder.OpRecorder`) and ``detctx.recording`` /
``detctx record`` (``detctx._compare``'s ``StatisticsRecorder``) share: the
mode, the module tracker, where an op ran, and the fork story.
"""

from __future__ import annotations

import abc
import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Final

import torch

from detctx._basics import MissingDependencyError
from detctx._locate.callsite import UNKNOWN, keep_for_backward, user_line, user_line_in_backward
from detctx._locate.eager import compile_eagerly
from detctx._locate.modules import ModuleTracker

__all__ = ["Recorder", "dispatch_mode", "dispatch_mode_class"]

_KEY: Final = "detctx._locate"


def dispatch_mode_class() -> type[Any]:
    """torch's ``TorchDispatchMode`` (private API; present in torch 2.1 and later)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        raise MissingDependencyError(
            "recording ops needs torch.utils._python_dispatch.TorchDispatchMode, which this "
            f"torch {torch.__version__} does not have: install torch 2.1 or later"
        ) from None
    return TorchDispatchMode


@functools.cache
def _forwarding_mode() -> type[Any]:
    base = dispatch_mode_class()

    class ForwardingMode(base):  # type: ignore[misc, valid-type]
        def __init__(self, recorder: Any) -> None:
            super().__init__()
            self.recorder = recorder
            self.restores: list[Callable[[], None]] = []

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # Recent torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo
            # unless the mode says no (as torch/utils/_python_dispatch.py documents);
            # the wrapper costs about as much as recording a small op (some 16 us a
            # dispatch), and nothing is compiled while recording (compile_eagerly).
            return False

        def __enter__(self) -> Any:
            restore = compile_eagerly()
            try:
                entered = super().__enter__()
            except BaseException:
                restore()
                raise
            self.restores.append(restore)
            return entered

        def __exit__(self, *exc: Any) -> Any:
            try:
                return super().__exit__(*exc)
            finally:
                if self.restores:
                    self.restores.pop()()

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            return self.recorder.dispatch(func, args, kwargs or {})

    return ForwardingMode


def dispatch_mode(recorder: Any) -> Any:
    """A ``TorchDispatchMode`` (not entered) that hands every op it sees, below autograd,
    to ``recorder.dispatch(func, args, kwargs)`` and returns what that returns."""
    return _forwarding_mode()(recorder)


_recording: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _before_fork() -> None:
    for recorder in list(_recording):
        recorder.before_fork()


def _after_fork_in_child() -> None:
    # A child forked while recording (a DataLoader worker) must not write into the
    # parent's trace, nor digest what the parent staged: OpenMP's threads do not survive
    # a fork, and a parallel op run before the worker's own set_num_threads(1) waits for
    # them forever.
    for recorder in list(_recording):
        recorder.abandon()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


class Recorder(abc.ABC):
    """The one op recorder: ``locate_divergence``, ``detctx run --locate``,
    ``detctx.recording`` and ``detctx record`` all record through it.

    Between :meth:`start` and :meth:`stop` a dispatch mode hands every op to
    :meth:`dispatch`, which a subclass writes: what it keeps of each op (digests
    only, or digests, statistics and the data flow). This class owns what they
    share: the mode, the module tracker, where an op ran (:meth:`where`: module
    path, source line, and for a backward op its forward op's place, kept in the
    autograd node's ``metadata`` under :attr:`KEY`), and the fork story (before a
    fork :meth:`before_fork`; in a forked child :meth:`abandon`, nothing more
    written). Subclasses fill in :meth:`_close` (after the mode is left, also
    when it could not be entered) and :meth:`_forget` (in a forked child).
    """

    KEY: ClassVar[str] = _KEY

    def __init__(self) -> None:
        self.modules = ModuleTracker()
        self._mode: Any = None
        self.thread = 0
        self._pending: tuple[list[torch.Tensor], tuple[str, str]] | None = None
        self._current_node: Callable[[], Any] | None = getattr(
            torch._C, "_current_autograd_node", None
        )

    def start(self) -> None:
        self.modules.start()
        try:
            self._opened()
            self._mode = dispatch_mode(self)
            self._mode.__enter__()
        except BaseException:
            self._mode = None
            self.modules.stop()
            self._close()
            raise
        self.thread = threading.get_ident()
        _recording.add(self)

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        _recording.discard(self)
        try:
            mode.__exit__(None, None, None)
        finally:
            self.modules.stop()
            self.annotate()
            self._close()

    def abandon(self) -> None:
        """Stop in a forked child: nothing more is kept or written.

        The mode sits on the stack of the thread that started it, so only a child
        forked from that thread pops it; in any other, that thread does not exist.
        """
        mode, self._mode = self._mode, None
        _recording.discard(self)
        self._pending = None
        self._forget()
        self.modules.stop()
        if mode is not None and self.thread == threading.get_ident():
            mode.__exit__(None, None, None)

    def before_fork(self) -> None:  # noqa: B027 (optional: most recorders need nothing)
        """Called before this process forks while recording."""

    def _opened(self) -> None:  # noqa: B027 (optional: most recorders need nothing)
        """Once the module tracker runs, before the mode is entered."""

    @abc.abstractmethod
    def _close(self) -> None:
        """After the mode is left (or could not be entered): hand over or write what is
        left."""

    @abc.abstractmethod
    def _forget(self) -> None:
        """In a forked child: drop what is kept, write nothing."""

    @abc.abstractmethod
    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What the recorder does with one op (and returns its result): the subclass's."""

    def annotate(self) -> None:
        """Keep the place of the last forward op in the autograd nodes of its outputs (made
        once the op has returned, so it is done at the next op)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            keep_for_backward(pending[0], self.KEY, pending[1])

    def where(self, outputs: list[torch.Tensor]) -> tuple[str, str, str]:
        """Module path, source line and autograd node (``""`` in the forward pass) of the op
        :meth:`dispatch` is handling, which made ``outputs``."""
        node = self._current_node() if self._current_node is not None else None
        if node is not None:
            metadata = getattr(node, "metadata", None)
            forward = metadata.get(self.KEY) if isinstance(metadata, dict) else None
            module_path, source = forward if forward is not None else ("", UNKNOWN)
            return module_path, user_line_in_backward(4) or source, node.name()
        module_path, source = self.modules.current(), user_line(4)
        if not module_path:
            source = self.outside_modules(outputs, source)
        # Kept for the op's autograd node, which exists once the op has returned; with
        # grad off too: inside a custom autograd Function's forward it is, and the tensors
        # the forward returns get the Function's node when it returns, so its backward ops
        # are placed at the module that called it.
        self._pending = (outputs, (module_path, source))
        return module_path, source, ""

    def outside_modules(self, outputs: list[torch.Tensor], source: str) -> str:
        """The source text of an op that ran outside every module (an optimizer's update)."""
        return source
