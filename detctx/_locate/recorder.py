"""Record every ATen op a block of code runs: name, module, source line, output digest.

The recorder is a ``TorchDispatchMode``: torch calls it for every op below
autograd, in the forward and the backward pass alike (the autograd engine
carries the mode to the thread that runs the backward). It lives in
``torch.utils._python_dispatch``, a private torch module, so it is looked
up when recording starts and a missing one is reported as
:class:`~detctx.MissingDependencyError` rather than a crash.

For each op with tensor outputs the recorder hands an :class:`OpRecord` and
the outputs to a sink. The outputs are what the op returned plus what it
wrote in place (``add_``, ``_foreach_mul_`` and ``out=`` variants, whose
output is their mutated input). Pure views (``t``, ``view``, ``detach``)
carry no new values and are not recorded. For a random op (tagged
``nondeterministic_seeded``) the state of the generator it draws from is
digested before it runs, so a stream advanced elsewhere is told apart from
a numerical difference.

An op of the backward pass is attributed to the forward op that made its
autograd node: the module path and source line of each forward op are kept
in its node's ``metadata`` and read back through
``torch._C._current_autograd_node`` (feature-detected; without it backward
ops carry only their node's name).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final, Protocol

import torch

from detctx._basics import MissingDependencyError
from detctx._locate.callsite import UNKNOWN, user_line, user_line_in_backward
from detctx._locate.digest import digest, layout_code
from detctx._locate.modules import ModuleTracker
from detctx._locate.trace import OpRecord

__all__ = ["OpRecorder", "Sink", "dispatch_mode_class"]

_KEY: Final = "detctx._locate"
_MASK: Final = (1 << 128) - 1
_PRIME: Final = 0x0000000001000000000000000000013B
_OFFSET: Final = 0x6C62272E07BB014262B821756295C58D


class Sink(Protocol):
    """Where records go: a trace file, a comparison with an earlier run, a capture."""

    def add(self, record: OpRecord, outputs: list[torch.Tensor]) -> None: ...


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


class _OpInfo:
    __slots__ = ("name", "random", "skip", "written")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        overload = func._overloadname
        self.name = schema.name if overload == "default" else f"{schema.name}.{overload}"
        tags = getattr(func, "tags", ())
        seeded = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)
        self.random = seeded is not None and seeded in tags
        self.written = tuple(
            (index, argument.name)
            for index, argument in enumerate(schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        )
        returns = schema.returns
        self.skip = (
            (
                bool(returns)
                and not self.written
                and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
            )
            or schema.name in _UNCOMPUTED
            or schema.name in _ALIASES
            or schema.name in _COPIES
            or schema.name.startswith("profiler::")
        )


def _generator_state(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    generator = kwargs.get("generator")
    if not isinstance(generator, torch.Generator):
        device = kwargs.get("device")
        if device is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), "cpu")
        device = torch.device(device)
        if device.type == "cpu":
            generator = torch.default_generator
        else:
            module = getattr(torch, device.type, None)
            generators = getattr(module, "default_generators", ())
            if not generators:
                return 0
            index = device.index if device.index is not None else module.current_device()
            if index >= len(generators):
                return 0
            generator = generators[index]
    state = generator.get_state()
    return int.from_bytes(
        hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest(), "little"
    )


_UNCOMPUTED: Final = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::empty_permuted",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::resize_",
        "aten::set_",
    }
)
"""Ops that compute nothing, skipped like views: uninitialised memory, or a tensor
pointed at existing memory.

Their outputs are whatever was in memory (the op that fills them is
recorded), and a DataLoader's main process runs ``empty`` + ``set_`` for each
batch as it arrives from a worker, in arrival order, which differs from run
to run although the loader hands batches out in order. The first op that
reads such a tensor is where its values count.
"""

_ALIASES: Final = frozenset({"aten::_unsafe_view"})
"""Views whose schema does not say so, skipped like the others: the output is the
input's memory under another shape.

``_unsafe_view`` is the reshape that ``matmul`` and ``bmm``'s callers run on
every product; digesting it read each product's bytes twice (a tenth of all
bytes digested in a nanoGPT step).
"""

_COPIES: Final = frozenset({"aten::clone", "aten::select_backward", "aten::slice_backward"})
"""Ops that only move bits, skipped like views: the output holds exactly the input's
bits (``clone``) or those bits and zeros (the backward of ``select`` and ``slice``).

Given the same input they give the same bits on every device, so a difference
in their output is a difference in their input, which the op that made it
shows. A tensor from outside torch (a NumPy write into its memory) counts at
the first op that computes from it, not at a copy of it. In a nanoGPT step
they are a sixth of the bytes a step makes (``nn.MultiheadAttention``'s
backward runs a ``select_backward`` of three times the activations per layer).
"""

_DTYPES: dict[torch.dtype, str] = {}
_DEVICES: dict[torch.device, str] = {}


def _combine(outputs: list[torch.Tensor]) -> int:
    # FNV-1a over 128-bit parts: each step is a bijection of the running value, so a
    # change in any one output's digest always changes the result.
    value = _OFFSET
    for tensor in outputs:
        bits = digest(tensor)
        if bits is None:
            bits = layout_code(tensor.dtype, tuple(tensor.shape))
        value = ((value ^ bits) * _PRIME) & _MASK
    return value


@functools.cache
def _recording_mode() -> type[Any]:
    base = dispatch_mode_class()

    class RecordingMode(base):  # type: ignore[misc, valid-type]
        def __init__(self, recorder: OpRecorder) -> None:
            super().__init__()
            self.recorder = recorder

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # Recent torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo
            # unless the mode says no (as torch/utils/_python_dispatch.py documents);
            # the wrapper costs about as much as recording a small op, and nothing
            # here is compiled.
            return False

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            return self.recorder.dispatch(func, args, kwargs or {})

    return RecordingMode


class _Discard:
    def add(self, record: OpRecord, outputs: list[torch.Tensor]) -> None:
        return None


_recording: weakref.WeakSet[OpRecorder] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A child forked while recording (a DataLoader worker) must not write into the
    # parent's trace; the mode sits on the stack of the thread that started it, so
    # only a child forked from that thread can pop it.
    for recorder in list(_recording):
        recorder.sink = _Discard()
        if recorder.thread == threading.get_ident():
            recorder.stop()


os.register_at_fork(after_in_child=_after_fork_in_child)


class OpRecorder:
    """Records ops into ``sink`` between :meth:`start` and :meth:`stop`, in this thread.

    >>> recorder = OpRecorder(sink)   # doctest: +SKIP
    >>> recorder.start(); model(x).sum().backward(); recorder.stop()  # doctest: +SKIP
    """

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.modules = ModuleTracker()
        self._mode: Any = None
        self.thread = 0
        self._infos: dict[Any, _OpInfo] = {}
        self._pending: tuple[list[torch.Tensor], str, str] | None = None
        self._current_node: Callable[[], Any] | None = getattr(
            torch._C, "_current_autograd_node", None
        )

    def start(self) -> None:
        mode_class = _recording_mode()
        self.modules.start()
        try:
            self._mode = mode_class(self)
            self._mode.__enter__()
        except BaseException:
            self.modules.stop()
            self._mode = None
            raise
        self.thread = threading.get_ident()
        _recording.add(self)

    def stop(self) -> None:
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        _recording.discard(self)
        try:
            mode.__exit__(None, None, None)
        finally:
            self.modules.stop()
            self._annotate()

    def _annotate(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        outputs, module_path, source = pending
        for tensor in outputs:
            node = tensor.grad_fn
            if node is not None:
                metadata = getattr(node, "metadata", None)
                if isinstance(metadata, dict):
                    metadata.setdefault(_KEY, (module_path, source))

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        info = self._infos.get(func)
        if info is None:
            info = self._infos[func] = _OpInfo(func)
        if self._pending is not None:
            self._annotate()
        if info.skip:
            return func(*args, **kwargs)
        rng = _generator_state(func, args, kwargs) if info.random else None
        result = func(*args, **kwargs)
        outputs = _tensors(result)
        for index, name in info.written:
            argument = args[index] if index < len(args) else kwargs.get(name)
            outputs.extend(t for t in _tensors(argument) if not any(t is o for o in outputs))
        if not outputs:
            return result
        node = self._current_node() if self._current_node is not None else None
        if node is not None:
            metadata = getattr(node, "metadata", None)
            where = metadata.get(_KEY) if isinstance(metadata, dict) else None
            module_path, source = where if where is not None else ("", UNKNOWN)
            source = user_line_in_backward(3) or source
            node_name = node.name()
        else:
            module_path, source, node_name = self.modules.current(), user_line(3), ""
            if torch.is_grad_enabled():
                self._pending = (outputs, module_path, source)
        first = outputs[0]
        dtype = _DTYPES.get(first.dtype)
        if dtype is None:
            dtype = _DTYPES[first.dtype] = str(first.dtype).removeprefix("torch.")
        device = _DEVICES.get(first.device)
        if device is None:
            device = _DEVICES[first.device] = str(first.device)
        record = OpRecord(
            info.name,
            module_path,
            source,
            node_name,
            dtype,
            tuple(first.shape),
            device,
            _combine(outputs),
            rng,
        )
        self.sink.add(record, outputs)
        return result


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []
