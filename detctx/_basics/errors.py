"""Exception and warning classes raised by detctx."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "DetctxError",
    "DeterminismUnavailableError",
    "DeterminismWarning",
    "MetricsError",
    "MissingDependencyError",
    "NotReproducibleError",
    "OutOfOrderExitError",
    "RankDivergenceError",
    "SeedAgreementError",
    "SeedMismatchError",
    "TraceError",
    "UndeclaredStreamError",
]


class DetctxError(Exception):
    """Base class of every error detctx raises on purpose."""


class OutOfOrderExitError(DetctxError, RuntimeError):
    """A ``deterministic`` block was exited while a block entered after it was still open.

    This happens when two asyncio tasks (or two hand-driven generators) hold
    overlapping ``with deterministic(...)`` blocks in one thread. Their RNG
    states cannot both be right, so detctx restores the state from before the
    outermost affected block and raises this error in each of them. Decorate
    the coroutine or generator function instead: the decorator gives each one
    its own RNG world.
    """


class DeterminismWarning(UserWarning):
    """A determinism switch could not take (full) effect; the message says what to do."""


class CheckpointError(DetctxError, ValueError):
    """A saved RNG state dict cannot be brought back in this process.

    The message names the source and the reason: a dict from another
    format version, a source saved but not registered here (register it
    before restoring), a source registered here but absent from the dict
    (pass ``strict=False`` to leave it alone), or a state that does not match
    the source it is meant for.
    """


class NotReproducibleError(DetctxError, AssertionError):
    """Runs that should have been identical were not.

    Raised by :func:`detctx.check_reproducible` and
    :func:`detctx.check_gradients`. ``path`` names the first differing leaf
    (``result["logits"][3]``), ``run`` the run that differed from the first
    (1-based), ``mismatched`` / ``total`` how many elements of that leaf
    differ, and ``max_abs_diff`` the largest absolute difference among them
    (``None`` when it has no meaning, as for differing types or shapes).
    When every result agrees but the runs left the RNGs in different states,
    ``path`` is ``None`` and ``sources`` names the RNG sources that differ.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        run: int = 2,
        mismatched: int = 0,
        total: int = 0,
        max_abs_diff: float | None = None,
        sources: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.path = path
        self.run = run
        self.mismatched = mismatched
        self.total = total
        self.max_abs_diff = max_abs_diff
        self.sources = sources


class MetricsError(DetctxError, ValueError):
    """No metric curve could be read: a log file is missing or unreadable, or no
    line matched the metric pattern (pass ``--pattern`` with a group around
    the number)."""


class MissingDependencyError(DetctxError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class SeedMismatchError(DetctxError, ValueError):
    """The ranks of a process group entered ``distributed_deterministic`` with different seeds.

    Raised on every rank, with the same message, after one collective: no
    rank is left waiting. ``seeds[r]`` is the seed group rank ``r`` passed
    (``None`` where it passed ``seed=None``); ``per_rank[r]`` its ``per_rank``.
    Pass the same seed on every rank, or ``seed=None`` everywhere to let the
    source rank draw one and share it.
    """

    def __init__(
        self, message: str, seeds: tuple[int | None, ...], per_rank: tuple[bool, ...]
    ) -> None:
        super().__init__(message)
        self.seeds = seeds
        self.per_rank = per_rank


class RankDivergenceError(DetctxError, RuntimeError):
    """The RNG states of some ranks differ from the rest of their process group.

    Raised on every rank by ``verify_across_ranks``, with the same message.
    ``divergent`` maps each group rank that differs from the majority to what
    differs: source names (``"torch"``, ``"numpy"``, ...), ``"seed"`` (the
    agreed seed), ``"derivation"`` (a per-rank seed not derived from the
    shared one), ``"sources"`` (a different set of managed RNG sources) or
    ``"block"`` (not inside the same kind of ``distributed_deterministic``
    block).
    """

    def __init__(self, message: str, divergent: dict[int, tuple[str, ...]]) -> None:
        super().__init__(message)
        self.divergent = divergent


class DeterminismUnavailableError(DetctxError, RuntimeError):
    """The device refused a determinism setting a block asked for (``npu_level=3`` on a
    chip or runtime without batch consistency, say); the block was not entered and
    nothing was left changed. The message names a setting that works."""


class TraceError(DetctxError, ValueError):
    """An op trace (written by ``detctx run --locate``) cannot be read back.

    The message names the file, the byte offset and what is wrong: not a
    trace, another format version, a record cut short (the run was killed
    or left through ``os._exit`` before its trace was closed), or a record
    that does not make sense. Run again to record a fresh trace.
    """


class SeedAgreementError(DetctxError, RuntimeError):
    """The ranks of a process group could not finish one of detctx's collectives together.

    Raised by :func:`~detctx.distributed.agree_seed`, ``distributed_deterministic``
    and ``verify_across_ranks`` on the ranks that were waiting, instead of
    hanging until the process group's own timeout:

    - ``missing``: the group ranks that did not arrive within ``timeout``
      seconds (the ranks this rank waited for); ``None`` where that cannot be
      told (no store reachable);
    - ``failed``: on leaving a ``verify=True`` block, each group rank that
      raised inside the block, mapped to its exception's class name
      (``{1: "ValueError"}``). The rank that raised gets its own exception.

    After a timeout the process group is left unusable (gloo closes its
    connections); stop the job, or destroy and re-create the group.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: tuple[int, ...] | None = None,
        failed: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.missing = missing
        self.failed = {} if failed is None else failed


class UndeclaredStreamError(DetctxError, RuntimeError):
    """An elastic loader's dataset or collator drew from an RNG stream its ``streams=`` left out.

    ``detctx.elastic_loader(..., streams=("torch",))`` seeds only the named
    streams for each sample; a draw from another one would depend on which
    worker loaded the sample. The first batch each process loads is checked;
    the message names the streams to add.
    """
