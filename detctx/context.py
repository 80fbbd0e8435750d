"""``deterministic(seed=...)``: seed, switch on determinism, restore everything.

The object holds only its configuration. Each entry pushes a fresh frame (the
snapshot taken on entry and the run it started) on a module-level stack and
each exit pops it, so one object can be entered many times, nested and used
recursively.

Concurrency: the RNGs are process-global, so blocks are serialised across
threads by one re-entrant lock, held from entry to exit; a thread entering a
block waits until another thread's block has exited. Inside one thread, blocks
must exit in the reverse order of entry. Two asyncio tasks (or hand-driven
generators) holding overlapping ``with`` blocks break that order; the first
out-of-order exit is detected, the state from before the outermost affected
block is restored, and :class:`~detctx.errors.OutOfOrderExitError` is raised
in each affected block.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

from detctx.accelerators import active_accelerators
from detctx.errors import DeterminismWarning, OutOfOrderExitError
from detctx.seeds import DEFAULT_SEED, resolve_seed, validate_seed
from detctx.sources import RNGSource
from detctx.state import RNGState, active_sources
from detctx.switches import Switch, default_switches

__all__ = ["Run", "Snapshot", "deterministic", "seed_all"]

logger = logging.getLogger("detctx")

F = TypeVar("F", bound=Callable[..., Any])


def _npu_initialized() -> bool:
    # Ascend reads the deterministic state once per thread (see AlgorithmsSwitch).
    return any(acc.device_type == "npu" and acc.is_initialized() for acc in active_accelerators())


_SWITCHES: list[Switch] = default_switches(_npu_initialized)


@dataclass(frozen=True)
class Run:
    """What one entry of a block (or one ``seed_all`` call) applied.

    ``seed`` is the seed used: with ``seed=None`` it is the one read from
    ``DETCTX_SEED`` or drawn from OS entropy, so the run can be repeated with
    ``deterministic(seed=run.seed)``.
    """

    seed: int
    sources: tuple[str, ...]
    switches: tuple[str, ...]

    def describe(self) -> str:
        """The log line's text: seed, sources and switches."""
        return (
            f"seed={self.seed}; sources: {', '.join(self.sources)}; "
            f"switches: {', '.join(self.switches) or 'none'}"
        )


class Snapshot:
    """Every managed RNG state plus every determinism switch, at one moment."""

    __slots__ = ("rng", "switches")

    def __init__(self, rng: RNGState, switches: list[tuple[Switch, Any]]) -> None:
        self.rng = rng
        self.switches = switches

    @classmethod
    def capture(cls, sources: list[tuple[str, RNGSource]] | None = None) -> Snapshot:
        return cls(RNGState.capture(sources), [(sw, sw.capture()) for sw in _SWITCHES])

    def restore(self, unchanged: Snapshot | None = None) -> None:
        """Put everything back; every part is attempted, the first error is raised after.

        ``unchanged``: a snapshot of the present state; switches whose value is
        the same there are left alone (a generator step swaps worlds twice, so
        skipping no-op writes of flags and environment variables matters).
        """
        first_error: BaseException | None = None
        now = None if unchanged is None else unchanged.switches
        for index in range(len(self.switches) - 1, -1, -1):
            switch, saved = self.switches[index]
            if now is not None and now[index][1] == saved:
                continue
            try:
                switch.restore(saved)
            except Exception as exc:
                first_error = first_error or exc
        try:
            self.rng.restore()
        except Exception as exc:
            first_error = first_error or exc
        if first_error is not None:
            raise first_error


class _Options:
    """Validated settings of one ``deterministic`` / ``seed_all`` configuration."""

    __slots__ = ("seed", "settings")

    def __init__(self, seed: object, settings: dict[str, object]) -> None:
        self.seed = None if seed is None else validate_seed(seed)
        by_name = {sw.name: sw for sw in _SWITCHES}
        for name, setting in settings.items():
            by_name[name].validate(setting)
        self.settings = settings

    def apply(
        self, sources: list[tuple[str, RNGSource]], seed: int, snapshot: Snapshot | None = None
    ) -> Run:
        """Seed every source with ``seed`` and set every switch.

        ``snapshot``, if given, was captured just before: its switch values are
        reused instead of being read again.
        """
        for _, source in sources:
            source.seed(seed)
        applied = []
        saved = snapshot.switches if snapshot is not None else None
        for index, switch in enumerate(_SWITCHES):
            current = saved[index][1] if saved is not None else switch.capture()
            description = switch.apply(self.settings[switch.name], seed, current)
            if description is not None:
                applied.append(description)
        run = Run(seed, tuple(name for name, _ in sources), tuple(applied))
        if logger.isEnabledFor(logging.INFO):
            logger.info("deterministic computing is applied: %s", run.describe())
        return run


class _Frame:
    __slots__ = ("closed", "owner", "run", "snapshot")

    def __init__(self, owner: deterministic, snapshot: Snapshot, run: Run) -> None:
        self.owner = owner
        self.snapshot = snapshot
        self.run = run
        self.closed = False


_lock = threading.RLock()
_WAIT_BEFORE_WARNING_S = 10.0


def _acquire() -> None:
    """Take the process-wide lock; say so if another thread's block keeps us waiting."""
    if _lock.acquire(timeout=_WAIT_BEFORE_WARNING_S):
        return
    warnings.warn(
        f"{threading.current_thread().name} has waited {_WAIT_BEFORE_WARNING_S:.0f} s for "
        "another thread's deterministic block to exit (blocks are serialised across threads). "
        "If that thread is waiting for this one, this is a deadlock: do not enter blocks in "
        "threads that a block's owner waits for.",
        DeterminismWarning,
        stacklevel=3,
    )
    _lock.acquire()


_stack: list[_Frame] = []
# The frames entered in the current context (thread or asyncio task), innermost last:
# it tells which frame an exit belongs to, and so whether exits come out of order.
_entered: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar(
    "detctx_entered", default=()
)


class deterministic:
    """Make a block of PyTorch work reproducible and leave the process as it was.

    On entry it snapshots every RNG (Python ``random``, NumPy's global
    generator, torch's CPU generator, every available accelerator, registered
    sources), the algorithm flags and the determinism environment variables;
    seeds every RNG with ``seed``; and switches determinism on. On exit (normal,
    exception, ``KeyboardInterrupt``, ``return``) it restores all of it.

    ``seed``: an integer in ``[0, 2**32 - 1]`` (default 1234, MindSpeed's), or
    ``None`` for ``$DETCTX_SEED`` if set, else a fresh seed from OS entropy.
    After entry, draws from ``random``, ``np.random`` and ``torch`` equal those
    after ``random.seed(s); np.random.seed(s); torch.manual_seed(s)``.

    Switches (each can be turned off with ``False``):

    - ``algorithms``: ``torch.use_deterministic_algorithms(True)``; ``"warn"``
      sets ``warn_only=True``.
    - ``cudnn``: ``cudnn.deterministic = True``, ``cudnn.benchmark = False``.
    - ``hash_seed``: ``PYTHONHASHSEED=str(seed)`` for child processes (this
      process's hash seed is fixed at its start).
    - ``cublas_workspace``: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (``:16:8`` kept).
    - ``hccl``: ``HCCL_DETERMINISTIC=true``; ``"strict"`` for ``strict``.
    - ``matmul_k_shift``: ``CLOSE_MATMUL_K_SHIFT=1`` (Ascend matmul order).
    - ``flash_attention``: ``FLASH_ATTENTION_DETERMINISTIC=1``.

    Entering returns a :class:`Run` with the seed used. Bad arguments raise
    ``TypeError`` / ``ValueError`` here, before anything is changed.
    """

    def __init__(
        self,
        seed: int | None = DEFAULT_SEED,
        *,
        algorithms: bool | Literal["warn"] = True,
        cudnn: bool = True,
        hash_seed: bool = True,
        cublas_workspace: bool = True,
        hccl: bool | Literal["strict"] = True,
        matmul_k_shift: bool = True,
        flash_attention: bool = True,
    ) -> None:
        self._options = _Options(
            seed,
            {
                "algorithms": algorithms,
                "cudnn": cudnn,
                "hash_seed": hash_seed,
                "cublas_workspace": cublas_workspace,
                "hccl": hccl,
                "matmul_k_shift": matmul_k_shift,
                "flash_attention": flash_attention,
            },
        )

    @property
    def seed(self) -> int | None:
        """The configured seed (``None``: resolved on each entry)."""
        return self._options.seed

    def __repr__(self) -> str:
        changed = ", ".join(
            f"{name}={value!r}"
            for name, value in self._options.settings.items()
            if value is not True
        )
        return f"deterministic(seed={self.seed!r}{', ' if changed else ''}{changed})"

    def _resolve_seed(self) -> int:
        """The seed for one entry: the configured one, else ``$DETCTX_SEED`` or a fresh one."""
        return resolve_seed(self._options.seed)

    def __enter__(self) -> Run:
        seed = self._resolve_seed()
        _acquire()
        try:
            sources = active_sources()
            snapshot = Snapshot.capture(sources)
            try:
                run = self._options.apply(sources, seed, snapshot)
            except BaseException:
                snapshot.restore()
                raise
            frame = _Frame(self, snapshot, run)
            _stack.append(frame)
            _entered.set((*_entered.get(), frame))
        except BaseException:
            _lock.release()
            raise
        return run

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        entered = _entered.get()
        for position in range(len(entered) - 1, -1, -1):
            if entered[position].owner is self:
                break
        else:
            raise OutOfOrderExitError(f"{self!r} was exited without being entered in this context")
        frame = entered[position]
        _entered.set(entered[:position] + entered[position + 1 :])
        try:
            _close(frame)
        finally:
            _lock.release()

    @overload
    def __call__(self, func: F) -> F: ...
    @overload
    def __call__(self, func: type[Any]) -> type[Any]: ...
    def __call__(self, func: Any) -> Any:
        """Use the block as a decorator.

        - A function: each call runs in its own block.
        - A generator, async generator or coroutine function: each call's body
          runs in its own RNG world, seeded on its first step, swapped in on
          every resume and out (the caller's world put back) on every yield,
          ``await`` suspension, ``close``, ``throw``, return and exception.
        - A ``unittest.TestCase`` subclass: each test method is decorated.

        Anything else raises ``TypeError`` here. See :mod:`detctx.decorators`.
        """
        from detctx.decorators import decorate

        return decorate(self, func)


def _close(frame: _Frame) -> None:
    """Pop ``frame`` and restore its snapshot, or fail loudly if exits are out of order."""
    if frame.closed:
        raise OutOfOrderExitError(
            "this deterministic block's state was already restored when a block that "
            "encloses it exited first (overlapping blocks in two asyncio tasks or "
            "generators?); decorate the coroutine or generator function instead"
        )
    position = _stack.index(frame)
    later = _stack[position + 1 :]
    del _stack[position:]
    frame.closed = True
    for other in later:
        other.closed = True
    frame.snapshot.restore()
    if later:
        raise OutOfOrderExitError(
            f"a deterministic block (seed={frame.run.seed}) exited while {len(later)} block(s) "
            "entered after it were still open (overlapping blocks in two asyncio tasks or "
            "generators?); the state from before this block was restored. Decorate the "
            "coroutine or generator function instead: each call then gets its own RNG world"
        )


def seed_all(
    seed: int | None = DEFAULT_SEED,
    *,
    algorithms: bool | Literal["warn"] = True,
    cudnn: bool = True,
    hash_seed: bool = True,
    cublas_workspace: bool = True,
    hccl: bool | Literal["strict"] = True,
    matmul_k_shift: bool = True,
    flash_attention: bool = True,
) -> Run:
    """Seed everything and switch determinism on, for good (MindSpeed's ``seed_all``).

    The same seeding, switches and environment variables as entering
    :class:`deterministic` with the same arguments; nothing is ever restored.
    Returns the :class:`Run` (its ``seed`` is the one used).
    """
    options = deterministic(
        seed,
        algorithms=algorithms,
        cudnn=cudnn,
        hash_seed=hash_seed,
        cublas_workspace=cublas_workspace,
        hccl=hccl,
        matmul_k_shift=matmul_k_shift,
        flash_attention=flash_attention,
    )._options
    resolved = resolve_seed(options.seed)
    with _lock:
        return options.apply(active_sources(), resolved)
