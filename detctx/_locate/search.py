"""``locate_divergence``: run a function several times while recording; the first differing op."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detctx._basics import (
    DEFAULT_SEED,
    as_integer,
    resolve_seed,
    scratch_folder,
    validate_seed,
)
from detctx._blocks import deterministic
from detctx._locate.batch import RowReader, RowWriter
from detctx._locate.callsite import defined_at
from detctx._locate.divergence import Capture, Divergence, OpComparison, element_difference
from detctx._locate.outputs import ResultLeaf, first_result_difference, result_leaves

if TYPE_CHECKING:
    from detctx._locate.recorder import Sink

__all__ = ["locate_divergence"]


def _recorded(
    block: deterministic, sink: Sink, fn: Callable[..., Any], args: Any, kwargs: Any
) -> list[ResultLeaf]:
    """Run ``fn`` in ``block`` while recording into ``sink``; its result, digested."""
    # The recorder (and torch's private dispatch-mode module) loads on first use:
    # ``import detctx`` stays as fast as without locating.
    from detctx._locate.recorder import OpRecorder

    with block:
        recorder = OpRecorder(sink)
        recorder.start()
        try:
            result = fn(*args, **kwargs)
        finally:
            recorder.stop()
        # Digested at once: a later run may change what this one returned (the same
        # tensor, updated in place).
        return result_leaves(result)


def _result_divergence(
    fn: Callable[..., Any], first: list[ResultLeaf], other: list[ResultLeaf], run: int, ops: int
) -> Divergence | None:
    """A ``"result"`` divergence when run ``run``'s result differs from run 1's."""
    differs = first_result_difference(first, other)
    if differs is None:
        return None
    where = defined_at(fn)
    return Divergence(
        ops,
        "",
        "",
        where,
        differs.shape,
        differs.dtype,
        differs.device,
        "result",
        run,
        path=differs.path,
        reference=differs.what,
    )


def locate_divergence(
    fn: Callable[..., Any],
    *args: Any,
    runs: int = 2,
    seed: int | None = DEFAULT_SEED,
    **kwargs: Any,
) -> Divergence | None:
    """Run ``fn(*args, **kwargs)`` ``runs`` times, recording every op; the first that differs.

    Each run happens in a fresh ``deterministic(seed=seed)`` block, as in
    :func:`~detctx.check_reproducible` (``seed=None``: one seed resolved from
    ``$DETCTX_SEED`` or OS entropy, used for every run). While a run executes,
    every ATen op of this thread, forward and backward, is recorded: its
    name, the innermost ``nn.Module`` running, the user's source line, and a
    bit-exact digest of its outputs (see ``detctx/_locate/digest.py``). Run 1's
    records are streamed to a temporary file; each later run is compared
    with them op by op as it runs, a batch of ops at a time. Returns ``None`` when every run agrees
    with run 1, else a :class:`Divergence` for the first run that parts from
    it. When the differing op's values differ, run 1 is replayed once more
    to count the differing elements (used only if the replay agrees with
    run 1 on every op before that one). When every op agrees, the results of
    ``fn`` are compared too, digested as ops' outputs are (tensors, arrays,
    numbers and strings in lists, tuples, dicts and dataclasses; other
    objects are not compared): results that differ are a ``"result"``
    divergence, their difference having come from outside torch ops.
    ``check_reproducible(..., locate=True)`` counts the differing elements.

    >>> import detctx, torch
    >>> model = torch.nn.Linear(4, 2)
    >>> detctx.locate_divergence(lambda: model(torch.randn(3, 4)).sum().backward()) is None
    True

    Recording uses torch's private ``TorchDispatchMode``; without it this
    raises :class:`~detctx.MissingDependencyError`. ``fn``'s own
    keyword arguments named ``runs`` or ``seed`` must be bound with
    ``functools.partial``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    count = as_integer(runs)
    if count is None:
        raise TypeError(f"runs must be an integer, got {runs!r}")
    runs = count
    if runs < 2:
        raise ValueError(f"runs must be at least 2 to compare anything, got {runs}")
    block = deterministic(resolve_seed(None if seed is None else validate_seed(seed)))
    from detctx._locate.recorder import dispatch_mode_class

    dispatch_mode_class()
    # A folder of its own, locked while this process lives: the next recording removes it
    # if this one is killed before removing it itself.
    scratch = scratch_folder()
    try:
        return _located(block, scratch.path / "run1.rows", fn, args, kwargs, runs)
    finally:
        scratch.close()


def _located(
    block: deterministic,
    path: Path,
    fn: Callable[..., Any],
    args: Any,
    kwargs: Any,
    runs: int,
) -> Divergence | None:
    """Record run 1 into ``path``; compare each later run with it; the first divergence."""
    writer = RowWriter(path)
    try:
        first = _recorded(block, writer, fn, args, kwargs)
    finally:
        writer.close()
    for run in range(2, runs + 1):
        reference = RowReader(path, writer.count)
        comparison = OpComparison(reference, run)
        try:
            result = _recorded(block, comparison, fn, args, kwargs)
            found = comparison.finish()
        finally:
            reference.close()
        if found is None:
            found = _result_divergence(fn, first, result, run, writer.count)
        if found is None:
            continue
        if found.reason != "values" or comparison.reference_record is None:
            return found
        reference = RowReader(path, writer.count)
        replay = Capture(found.index, reference)
        try:
            _recorded(block, replay, fn, args, kwargs)
        finally:
            reference.close()
        if not replay.agreed:
            return found
        differs = element_difference(replay.tensors, comparison.tensors)
        if differs is None:
            return found
        return replace(
            found,
            output=differs.output,
            outputs=differs.outputs,
            dtype=differs.dtype,
            shape=differs.shape,
            mismatched=differs.mismatched,
            total=differs.total,
            max_abs_diff=differs.max_abs_diff,
        )
    return None
