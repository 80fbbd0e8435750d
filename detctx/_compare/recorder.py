"""Record, per ATen op, what a tolerance compare needs: where it ran, its outputs'
statistics and sketches, their digest, and which earlier op made each input.

A ``TorchDispatchMode`` (torch's private ``torch.utils._python_dispatch``,
looked up through :mod:`detctx._locate`) sees every op below autograd, forward
and backward. Ops that make no new values (views, copies, constants; the
``skip`` of locate's ``op_info``) are not recorded, as in locate. Each
recorded op gets its module path and source line from locate's machinery (a
backward op carries its forward op's, kept in the autograd node's
``metadata``), the statistics row of each output
(:mod:`detctx._compare.sketch`), the digest of its outputs (locate's, so
``bitwise`` means what locate's "same bits" means; both made by
:mod:`detctx._compare.summaries`, on a helper thread where a core is spare)
and, for each tensor it reads, the op and output that last wrote the tensor's
memory: the data flow. A view reads the memory its base was written to; a copy
(``clone``) passes its source's producer on; a parameter, buffer or constant no
recorded op made gets a row where first read; other memory written by no
recorded op (a batch from NumPy) has no producer, only its digest as read.
"""

from __future__ import annotations

import itertools
from typing import Any, Final

import torch

from detctx._basics import doing_own_work, own_work
from detctx._compare.collectives import (
    Issued,
    Kind,
    carries_objects,
    issue,
    kind,
    local,
    placements,
    plain_tensors,
    reads,
)
from detctx._compare.format import READ_OP, STATE_OP, Inputs, TraceWriter, Unseen
from detctx._compare.memory import Producers, memory_key
from detctx._compare.naming import TensorNames
from detctx._compare.portable import PortableRandom
from detctx._compare.scalars import scalar_arguments
from detctx._compare.summaries import Summaries, spare_core
from detctx._locate import PUBLIC_KEY, Recorder, new_values, op_info, tensor_digest

__all__ = ["StatisticsRecorder"]

_KEY: Final = "detctx._compare"
_PASSED_ON: Final = frozenset({"aten::clone", "aten::select_backward", "aten::slice_backward"})
"""Skipped ops whose output holds their first input's bits: its producer is passed on."""
_FILLS: Final = frozenset({"aten::fill_", "aten::zero_", "aten::copy_"})
"""In-place ops whose first argument's values are not read, only written."""
_SEEDED: Final = getattr(getattr(torch, "Tag", None), "nondeterministic_seeded", None)
_VIEWS: set[Any] = set()
"""Skipped ops whose every output aliases an input (views): their memory keeps its producer."""
_write_only: dict[Any, tuple[tuple[int, str], ...]] = {}
"""Per op: the places of the arguments it only writes (see _written)."""


_NONE: Final = (-1, 0)
"""The producer of data no recorded op made, as the trace writes it."""
_FRESH: Final = (-2, 0)
"""Memory an op not recorded made inside the recording (``empty``, a workspace)."""
_CONSTANT: Final = (-3, 0)
"""Memory a constant op made (``zeros_like``, ``arange``): a row where first read."""


def _every(issued: dict[int, list[Issued]]) -> list[Issued]:
    """Every collective in ``issued`` once, in the order issued."""
    found = {waiting.number: waiting for waiting in itertools.chain(*issued.values())}
    return [found[number] for number in sorted(found)]


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """The tensors ``func`` writes without reading their values, by ``id``: its ``out=``
    arguments, and the first argument of an op that fills it (``fill_``, ``zero_``,
    ``copy_``, a random fill such as ``bernoulli_``)."""
    places = _write_only.get(func)
    if places is None:
        schema = func._schema
        places = _write_only[func] = tuple(
            (position, argument.name)
            for position, argument in enumerate(schema.arguments)
            if argument.alias_info is not None
            and argument.alias_info.is_write
            and (argument.kwarg_only or (position == 0 and _fills(func)))
        )
    if not places:
        return set()
    values = [args[at] if at < len(args) else kwargs.get(name) for at, name in places]
    return {id(tensor) for tensor in plain_tensors(values)}  # out= may be a list (FSDP2's)


def _fills(func: Any) -> bool:
    name = func._schema.name
    return name in _FILLS or (name.endswith("_") and _SEEDED in getattr(func, "tags", ()))


class StatisticsRecorder(Recorder):
    """Records ops into ``writer`` between :meth:`start` and :meth:`stop`; with ``steps``
    ``(A, B)``, only the ops of optimizer steps ``A`` to ``B - 1``, the state entering step
    ``A`` first (see :mod:`detctx._basics.steps`). With ``portable``, every random op of the
    program, recorded or not (outside the window too), draws from it
    (:mod:`detctx._compare.portable`)."""

    KEY = _KEY

    def __init__(
        self,
        writer: TraceWriter,
        steps: tuple[int, int] | None = None,
        *,
        portable: PortableRandom | None = None,
    ) -> None:
        super().__init__()
        self.writer = writer
        self.portable = portable
        self.names = TensorNames(self.modules)
        self.count = 0
        self.window = steps
        self.steps_done = 0
        self._inside = steps is None or steps[0] == 0  # whether ops are recorded now
        self._step_hook: Any = None
        self._producers = Producers()
        self._issued: dict[int, list[Issued]] = {}  # output memory -> collectives not recorded
        self.summaries = Summaries(writer, helper=lambda: False)

    def start(self) -> None:
        self.summaries = Summaries(self.writer, helper=spare_core)
        super().start()

    def _opened(self) -> None:
        self.names.start()  # it reads the module tracker's paths
        if self.window is not None:
            from torch.optim import optimizer

            self._step_hook = optimizer.register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """An optimizer step completed: the window opens (its entering state recorded
        first) or closes."""
        assert self.window is not None
        self.steps_done += 1
        if self.steps_done == self.window[0]:
            with own_work():  # the copies of the state are not the program's ops
                self._record_state()
            self._inside = True
        elif self.steps_done == self.window[1]:
            self._inside = False

    def _record_state(self) -> None:
        """A row for each tensor of the state the window starts from, read by the ops that
        read it: two windows that start from different states differ at these rows."""
        for module_path, name, tensor in self.names.state():
            self._record((STATE_OP, module_path, f"[{name}]", "", ""), [local(tensor)], [])

    def _unhook(self) -> None:
        hook, self._step_hook = self._step_hook, None
        if hook is not None:
            hook.remove()

    def before_fork(self) -> None:
        # The helper finishes its queue, so the child inherits no thread mid torch call.
        # On this thread the mode is on: the rows' arithmetic is detctx's, not the program's.
        with own_work():
            self.summaries.drain()

    def _close(self) -> None:
        self._unhook()
        self.names.stop()
        try:
            self._complete(_every(self._issued))
        finally:
            self._producers.clear()
            self.summaries.close()  # every row written before the writer closes

    def _forget(self) -> None:
        self._unhook()
        self._issued.clear()
        self.summaries.abandon()
        self.writer.abandon()
        self.names.stop()

    def outside_modules(self, outputs: list[torch.Tensor], source: str) -> str:
        # An optimizer's update, outside every module: which parameter it writes.
        named = self.names.name_of(outputs)
        return source if named is None else f"{source} [{named}]"

    def _producer(self, tensor: torch.Tensor) -> tuple[int, int]:
        found = self._producers.writer_of(tensor)
        return found if found is not None and found[0] >= 0 else _NONE

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._inside or doing_own_work():
            # Outside the window of steps, or detctx's own work (agreements between
            # ranks, the copies of a window's entering state): not recorded. The program's
            # random ops still draw portably, so both runs enter the window alike.
            if self.portable is None or doing_own_work():
                return func(*args, **kwargs)
            return self.portable.call(func, args, kwargs)
        info = op_info(func)
        if self._pending is not None:
            self.annotate()
        if info.skip and func in _VIEWS:
            return info.call(*args, **kwargs)  # a view reads and writes nothing
        read = plain_tensors((*args, *kwargs.values()))
        if self._issued and reads(func):
            self._complete(self._touched(read))  # a collective completes before it is read
        role = kind(func)
        if role is not Kind.PLAIN:
            return self._collective(role, func, info, args, kwargs, read)
        if info.skip:
            result = info.call(*args, **kwargs)
            self._pass_on(func, info, read, plain_tensors([result]))
            return result
        inputs, unseen = self._inputs(read, _written(func, args, kwargs))
        if self.portable is not None and self.portable.handles(func):
            result = self.portable.call(func, args, kwargs)
        else:
            result = info.call(*args, **kwargs)
        outputs = new_values(info, args, kwargs, result)
        made = plain_tensors([result])
        if len(made) != len(outputs):
            # Results it does not keep (a recurrent layer's workspace): made here, not data
            # from before the recording, whatever their memory holds.
            kept = {id(tensor) for tensor in outputs}
            for tensor in made:
                if id(tensor) not in kept and self._producers.writer_of(tensor) is None:
                    self._producers.wrote(tensor, _FRESH)
        if not outputs:
            return result
        where = self.where(outputs)
        if any(type(t) is not torch.Tensor for t in outputs):
            noted = placements(outputs)  # DTensors: each rank's shard, its placements noted
            where = (where[0], f"{where[1]} [{noted}]" if noted else where[1], where[2])
            outputs = [local(tensor) for tensor in outputs]
        strings = (info.name, *where, scalar_arguments(func, args, kwargs))
        self._record(strings, outputs, inputs, unseen)
        return result

    def _inputs(self, read: list[torch.Tensor], written: set[int]) -> tuple[Inputs, Unseen]:
        """The producer of each tensor ``read``; a parameter or buffer no recorded op made
        (before its first update), or a constant (an optimizer's first moments), gets a row
        of its own first, named: the compare then knows its values, and names it where it
        differs. Not one the op only writes (``written``, by ``id``: ``out=``, the one a
        random op fills). Other data no recorded op made (the batch, memory allocated where
        the recorder does not see it: FSDP2's resized storages, a collective's buffers) has
        no producer, only its digest as read (not memory made uninitialised): where it came
        from, and whether it is the same data in another run, is not known; whether it is
        the same bits is."""
        found: Inputs = []
        unseen: list[tuple[int, int]] = []
        for place, tensor in enumerate(read):
            known = self._producers.writer_of(tensor)
            if known is not None and known[0] >= 0:
                found.append(known)
                continue
            name = None if id(tensor) in written else self.names.name_of([tensor])
            if known == _CONSTANT and id(tensor) not in written:
                name = name or "constant"
            if name is not None and known in (None, _CONSTANT):
                with own_work():  # the row's copies are not the program's ops
                    row = (READ_OP, self.modules.current(), f"[{name}]", "", "")
                    self._record(row, [local(tensor)], [])
                found.append(self._producer(tensor))
                continue
            found.append(_NONE)
            if known is None and id(tensor) not in written:
                with own_work():
                    unseen.append((place, tensor_digest(local(tensor), key=PUBLIC_KEY) or 0))
        return found, tuple(unseen)

    def _record(
        self,
        strings: tuple[str, str, str, str, str],
        outputs: list[torch.Tensor],
        inputs: Inputs,
        unseen: Unseen = (),
    ) -> None:
        self.summaries.put(strings, outputs, inputs, unseen)
        for position, tensor in enumerate(outputs):
            self._producers.wrote(tensor, (self.count, position))
        self.count += 1

    def _collective(
        self,
        role: Kind,
        func: Any,
        info: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        read: list[torch.Tensor],
    ) -> Any:
        """A collective is recorded once it has completed (see :mod:`.collectives`)."""
        result = info.call(*args, **kwargs)
        if role is Kind.PASSING or role is Kind.SILENT:
            return result
        issued = None
        if role is Kind.COLLECTIVE and not carries_objects():
            issued = issue(func, args, kwargs, result)
        if issued is None:  # not recorded: what it writes has no producer
            for tensor in read:
                self._producers.forget(tensor)
            return result
        inputs, outputs, wait, group = issued
        module, source, node = self.where(outputs)
        keys = [memory_key(tensor) for tensor in outputs]
        waiting = Issued(
            (info.name, module, f"{source} [{group}]", node, ""),
            outputs,
            [self._producer(tensor) for tensor in inputs],
            wait,
            keys,
        )
        for key in set(keys):
            if key is not None:
                self._issued.setdefault(key, []).append(waiting)
        return result

    def _touched(self, read: list[torch.Tensor]) -> list[Issued]:
        """The collectives not recorded yet whose outputs share memory with ``read``."""
        found: dict[int, Issued] = {}
        for tensor in read:
            key = memory_key(tensor)
            for issued in self._issued.get(key, ()) if key is not None else ():
                found[issued.number] = issued
        return [found[number] for number in sorted(found)]

    def _complete(self, issued: list[Issued]) -> None:
        """Wait for each collective in ``issued`` and write its row, in the order issued."""
        for waiting in issued:
            for key in {key for key in waiting.keys if key is not None}:
                others = [other for other in self._issued.get(key, ()) if other is not waiting]
                if others:
                    self._issued[key] = others
                else:
                    self._issued.pop(key, None)
        for waiting in issued:
            try:
                waiting.wait()
            except RuntimeError:
                continue  # it failed: the program meets the error at its own wait
            if any(memory_key(tensor) != key for tensor, key in zip(waiting.outputs, waiting.keys)):
                continue  # its memory was freed or replaced (resize_): nothing left to read
            self._record(waiting.strings, waiting.outputs, waiting.inputs)

    def _pass_on(
        self, func: Any, info: Any, read: list[torch.Tensor], made: list[torch.Tensor]
    ) -> None:
        """A skipped op's new memory: its source's producer (a copy), a constant (its values
        follow from its arguments: ``zeros_like``, ``fill_`` with a number, in place too),
        or none (``empty``: memory that may hold anything)."""
        if not made:
            return
        if info.constant:
            for tensor in made:
                self._producers.wrote(tensor, _CONSTANT)
            return
        name = info.name
        if all(r.alias_info is not None for r in func._schema.returns) and len(
            func._schema.returns
        ) == len(made):
            _VIEWS.add(func)  # its outputs are its inputs' memory: nothing to pass on
            return
        source = self._producer(read[0]) if name in _PASSED_ON and read else None
        known = {memory_key(tensor) for tensor in read}
        for tensor in made:
            key = memory_key(tensor)
            if key is None or key in known:
                continue  # a view: the memory keeps its producer
            if source is None or source[0] < 0:
                self._producers.wrote(tensor, _FRESH)
            else:
                self._producers.wrote(tensor, source)
