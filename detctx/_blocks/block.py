"""``deterministic(seed=...)``: seed, switch on determinism, restore everything.

The object holds only its configuration (:class:`~detctx._blocks.settings.Settings`);
each entry is an open block of :mod:`detctx._blocks.stack`, so one object can be
entered many times, nested and used recursively, and the decorator forms
(:mod:`detctx._blocks.decorators`) stand on the same machinery.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, overload

from typing_extensions import Unpack

import detctx._blocks.stack as blocks
from detctx._basics import DEFAULT_SEED
from detctx._blocks.decorators import decorate
from detctx._blocks.settings import ALONE, Coordinator, Seeding, Settings
from detctx._state import Snapshot, interrupts, transaction
from detctx._switches import SwitchOptions

__all__ = ["deterministic", "open_blocks", "seed_all"]

F = TypeVar("F", bound=Callable[..., Any])


class deterministic:
    """Make a block of PyTorch work reproducible and leave the process as it was.

    On entry it snapshots every RNG (Python ``random``, NumPy's global
    generator, torch's CPU generator, every available accelerator, registered
    sources), the algorithm flags and the determinism environment variables;
    seeds every RNG with ``seed``; and switches determinism on. On exit (normal,
    exception, ``KeyboardInterrupt``, ``return``) it restores all of it::

        with detctx.deterministic(seed=1234) as seeding:
            train(model, loader)         # the same loss curve on every run
        # every RNG, flag and variable is as it was before the block

    ``seed``: an integer in ``[0, 2**32 - 1]`` (default 1234, MindSpeed's), or
    ``None`` for ``$DETCTX_SEED`` if set, else a fresh seed from OS entropy.
    After entry, draws from ``random``, ``np.random`` and ``torch`` equal those
    after ``random.seed(s); np.random.seed(s); torch.manual_seed(s)``.

    ``**switches``: the determinism switches, each on unless turned off with
    ``False``; their one declaration, with what each sets, is
    :class:`detctx.SwitchOptions` (the "Switches" table of docs/usage.md lists them).

    Entering returns a :class:`~detctx.Seeding` with the seed used.
    Bad arguments raise ``TypeError`` / ``ValueError`` here, before anything
    is changed.
    """

    def __init__(self, seed: int | None = DEFAULT_SEED, **switches: Unpack[SwitchOptions]) -> None:
        self._settings = Settings(
            seed, switches, caller=type(self).__name__, coordinator=self._coordinator()
        )

    def _coordinator(self) -> Coordinator:
        """How each entry's seed is decided (overridden by ``distributed_deterministic``)."""
        return ALONE

    @property
    def settings(self) -> Settings:
        """The validated configuration (seed and every switch's setting)."""
        return self._settings

    @property
    def seed(self) -> int | None:
        """The configured seed (``None``: resolved on each entry)."""
        return self._settings.seed

    def __repr__(self) -> str:
        settings = self._settings
        options = {**settings.changed(), **settings.coordinator.options()}
        extra = "".join(f", {name}={value!r}" for name, value in options.items())
        return f"{type(self).__name__}(seed={self.seed!r}{extra})"

    def __enter__(self) -> Seeding:
        settings = self._settings
        entry = settings.begin()  # may communicate (distributed); nothing is changed yet
        depth = len(blocks.entered_here())
        try:
            seeding = blocks.open_block(self, lambda before: settings.apply(entry, before))
            settings.coordinator.after_entry()
        except BaseException:
            blocks.abandon(self, depth)  # a failed check, or interrupted on the way out
            raise
        return seeding

    @interrupts.edge
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._settings.coordinator.before_exit(self, exc)
        finally:
            blocks.close_block(self)

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
        - A hypothesis ``@given`` test (decorate it outermost): each call is a
          block, and each example runs in its own entry of it, so every
          example starts from the seed, torch included.

        Anything else raises ``TypeError`` here. See :mod:`detctx._blocks.decorators`.
        """
        return decorate(self, func)


def seed_all(seed: int | None = DEFAULT_SEED, **switches: Unpack[SwitchOptions]) -> Seeding:
    """Seed everything and switch determinism on, for good (MindSpeed's ``seed_all``).

    The same seeding, switches and environment variables as entering
    :class:`deterministic` with the same arguments; nothing is ever restored,
    unless seeding fails (a registered source's ``seed`` raises): then every
    RNG, flag and variable is put back before the error is raised.
    Returns the :class:`~detctx._blocks.settings.Seeding` (its ``seed`` is the one used)::

        detctx.seed_all(1234)        # at the top of a training script
    """
    settings = Settings(seed, switches, caller="seed_all")
    entry = settings.begin()

    def make(before: Snapshot) -> Seeding:
        seeding = settings.apply(entry, before)
        before.keep_changes()
        return seeding

    return transaction.change(make, Snapshot.capture_everything, lasts=transaction.Lasts.DONE)


def open_blocks() -> tuple[Seeding, ...]:
    """What every block open now applied, outermost first (``()`` outside any block).

    Blocks are process-wide: this includes the blocks that enclose the caller.
    A decorated generator's or coroutine's own world is not a block; the
    blocks its body opens are, while one of its steps runs::

        with detctx.deterministic(seed=5):
            assert detctx.open_blocks()[-1].seed == 5
    """
    return tuple(block.seeding for block in blocks.stack())
