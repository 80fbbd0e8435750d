"""Record every ATen op a block of code runs: name, module, source line, output digest.

The recorder is a ``TorchDispatchMode``: torch calls it for every op below
autograd, in the forward and the backward pass alike (the autograd engine
carries the mode to the thread that runs the backward). It lives in
``torch.utils._python_dispatch``, a private torch module, so it is looked
up when recording starts and a missing one is reported as
:class:`~detctx.MissingDependencyError` rather than a crash.

Each op with tensor outputs becomes a row (:mod:`detctx._locate.batch`):
the op, where it ran, its first output's description and a digest of its
outputs. The outputs are what the op returned plus what it wrote in place
(``add_``, ``_foreach_mul_`` and ``out=`` variants, whose output is their
mutated input); a nested tensor counts as its components, described by
its padded shape (:mod:`detctx._locate.outputs`). Pure views (``t``,
``view``, ``detach``) carry no new values and are not recorded. For a random op (tagged
``nondeterministic_seeded``) the state of the generator it draws from is
digested before it runs, so a stream advanced elsewhere is told apart from
a numerical difference.

Digests cost the least in bulk: the bytes of small CPU outputs are copied
into a :class:`~detctx._locate.staging.Staging` buffer as each op runs and
digested together when it fills; rows go to the sink a :class:`Batch` at a
time. An output too large for the buffer, or on an accelerator, is
digested as its op runs. A sink that may need an op's tensors (to count
differing elements) says so through ``wants``: the recorder asks it about
each op digested at once, and copies that op's outputs if it answers yes;
a staged op's outputs come back from the buffer.

An op of the backward pass is attributed to the forward op that made its
autograd node: the place of each forward op is kept in its node's
``metadata`` and read back through ``torch._C._current_autograd_node``
(feature-detected; without it backward ops carry only their node's name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Protocol

import numpy as np
import torch

from detctx._locate.batch import ROW, Batch, meta_number, site_number
from detctx._locate.digest import STAGED
from detctx._locate.ops import generator_state, op_info
from detctx._locate.outputs import (
    combine_digests,
    describe,
    new_values,
    outputs_digest,
    unnested,
)
from detctx._locate.staging import Staging, borrow, give_back
from detctx._locate.tap import Recorder, dispatch_mode, dispatch_mode_class

__all__ = ["OpRecorder", "Recorder", "Sink", "dispatch_mode", "dispatch_mode_class"]

_WORD: Final = (1 << 64) - 1
PENDING: Final = 4096
"""Ops recorded before their rows go to the sink, at most (fewer when the buffer fills)."""


class Sink(Protocol):
    """Where rows go: a trace file, a comparison with an earlier run, a capture.

    A sink may also have ``wants(index, row) -> bool``: whether it needs the
    tensors of op ``index`` (digested as it ran, ``row`` its :data:`ROW`
    values), asked only for ops whose bytes are not kept in the buffer.
    """

    def add_batch(self, batch: Batch) -> None: ...


class _Discard:
    def add_batch(self, batch: Batch) -> None:
        return None


class OpRecorder(Recorder):
    """Records ops into ``sink`` between :meth:`start` and :meth:`stop`, in this thread:
    each op's place and a digest of its outputs (locate's rows).

    >>> recorder = OpRecorder(sink)   # doctest: +SKIP
    >>> recorder.start(); model(x).sum().backward(); recorder.stop()  # doctest: +SKIP

    Rows reach the sink in batches; :meth:`stop` hands over the last one.
    """

    def __init__(self, sink: Sink) -> None:
        super().__init__()
        self.sink = sink
        self.wants: Callable[[int, tuple[int, ...]], bool] | None = getattr(sink, "wants", None)
        self._staging: Staging | None = None
        self.count = 0  # ops handed to the sink
        # The rows not handed over yet, a column each.
        self._ops: list[int] = []
        self._sites: list[int] = []
        self._metas: list[int] = []
        self._rngs: list[int | None] = []
        self._entries: list[int] = []  # the op's first tensor in the buffer, or -1
        self._counts: list[int] = []  # how many of its tensors are in the buffer
        self._values: dict[int, int] = {}  # position -> digest, for ops digested at once
        self._kept: dict[int, list[torch.Tensor]] = {}  # position -> copies of outputs

    def start(self) -> None:
        if self._staging is None:
            self._staging = borrow()
        super().start()

    def _close(self) -> None:
        try:
            self.flush()
        finally:
            if self._staging is not None:
                give_back(self._staging)
                self._staging = None

    def _forget(self) -> None:
        self.sink, self.wants = _Discard(), None
        self._staging = None
        self._forget_rows()

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        info = op_info(func)
        if self._pending is not None:
            self.annotate()
        if info.skip:
            return info.call(*args, **kwargs)
        rng = generator_state(func, args, kwargs) if info.random else None
        result = info.call(*args, **kwargs)
        outputs = new_values(info, args, kwargs, result)
        if not outputs:
            return result
        where = site_number(*self.where(outputs))
        first = outputs[0]
        if len(outputs) == 1 and not first.is_nested:
            meta = meta_number(first.dtype, first.shape, first.device)
        else:
            meta, outputs = meta_number(*describe(first)), unnested(outputs)
        self._add(info.number, where, meta, rng, outputs)
        return result

    def _add(
        self, op: int, where: int, meta: int, rng: int | None, outputs: list[torch.Tensor]
    ) -> None:
        if len(self._ops) >= PENDING:
            self.flush()
        staging = self._staging
        entry, count = -1, 0
        if staging is not None and all(_stageable(tensor) for tensor in outputs):
            fits = staging.room_for(outputs)
            if not fits and self._ops:
                self.flush()
                fits = staging.room_for(outputs)
            if fits:
                entry = len(staging)
                for tensor in outputs:
                    staging.add(tensor)
                count = len(outputs)
        position = len(self._ops)
        if entry < 0:
            value = outputs_digest(outputs)
            self._values[position] = value
            wants = self.wants
            if wants is not None:
                row = (op, where, meta, rng is not None, rng or 0, value >> 64, value & _WORD)
                if wants(self.count + position, row):
                    self._kept[position] = [tensor.detach().clone() for tensor in outputs]
        self._ops.append(op)
        self._sites.append(where)
        self._metas.append(meta)
        self._rngs.append(rng)
        self._entries.append(entry)
        self._counts.append(count)
        if self._kept:
            # Handed over at once: once a run has parted, every later op may differ, and
            # copies kept until the buffer fills could add up to the run's activations.
            self.flush()

    def _tensors_of(self, position: int) -> list[torch.Tensor] | None:
        entry, staging = self._entries[position], self._staging
        if entry < 0 or staging is None:
            return self._kept.get(position)
        return [staging.tensor(entry + k) for k in range(self._counts[position])]

    def flush(self) -> None:
        """Hand the rows recorded so far to the sink, their digests computed."""
        count = len(self._ops)
        if not count:
            return
        rows = np.zeros(count, dtype=ROW)
        rows["op"] = self._ops
        rows["site"] = self._sites
        rows["meta"] = self._metas
        rows["random"] = [rng is not None for rng in self._rngs]
        rows["rng"] = [rng or 0 for rng in self._rngs]
        staging = self._staging
        empty = np.zeros(0, dtype=np.uint64)
        high, low = staging.digests() if staging is not None else (empty, empty)
        entries = np.array(self._entries, dtype=np.int64)
        counts = np.array(self._counts, dtype=np.int64)
        single = counts == 1
        rows["high"][single] = high[entries[single]]
        rows["low"][single] = low[entries[single]]
        for position in np.flatnonzero(~single).tolist():
            value = self._values.get(position)
            if value is None:
                entry = self._entries[position]
                value = combine_digests(
                    [
                        (int(high[k]) << 64) | int(low[k])
                        for k in range(entry, entry + self._counts[position])
                    ]
                )
            rows["high"][position] = value >> 64
            rows["low"][position] = value & _WORD
        try:
            self.sink.add_batch(Batch(self.count, rows, self._tensors_of))
        finally:
            self.count += count
            self._forget_rows()
            if staging is not None:
                staging.clear()

    def _forget_rows(self) -> None:
        """Drop the rows not handed over yet, with their digests and copies."""
        for column in (self._ops, self._sites, self._metas, self._rngs, self._entries):
            column.clear()
        self._counts.clear()
        self._values.clear()
        self._kept.clear()


def _stageable(tensor: torch.Tensor) -> bool:
    return (
        (type(tensor) is torch.Tensor or isinstance(tensor, torch.nn.Parameter))
        and tensor.is_cpu
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.nbytes <= STAGED
    )
