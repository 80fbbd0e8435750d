"""``DeterministicCallback``: a whole Lightning fit from one seed, evaluation in its own world.

A Lightning ``Callback`` for ``lightning.pytorch`` or ``pytorch_lightning``
(whichever the program imported; ``callback_class(framework)`` picks one
explicitly). Lightning is imported only when the class is first looked up::

    import lightning.pytorch as pl
    from detctx.integrations.lightning import DeterministicCallback

    trainer = pl.Trainer(max_epochs=3, callbacks=[DeterministicCallback(seed=1234)])
    trainer.fit(model, train_loader, val_loader)

What it does, in every process of the run (``ddp_spawn`` children too):

- ``setup``: enters ``detctx.deterministic(seed)`` for the whole stage (every
  RNG seeded exactly as ``seed_everything(seed)`` seeds it, determinism
  switched on as ``Trainer(deterministic=True)`` does) and exports
  ``PL_GLOBAL_SEED=seed``, which Lightning's DDP setup (``reset_seed``) and its
  ``DistributedSampler`` read, and ``PL_SEED_WORKERS=1``, so that Lightning
  gives every data loader without a ``worker_init_fn`` its
  ``pl_worker_init_function`` for the loader's rank: each worker of each rank
  gets its own seeds, the very seeds of ``seed_everything(seed, workers=True)``;
  ``teardown`` (or ``on_exception``) restores every RNG, switch and both
  ``PL_*`` variables. A ``seed_everything`` call after the callback's
  ``setup`` (in ``LightningModule.setup``, say) that changes the seed is
  warned about (:class:`~detctx.DeterminismWarning`) when the stage starts.
- Every validation run (the sanity check too), test, validate and predict
  loop runs in ``detctx.deterministic(eval_seed)``, from the creation of its
  data loader iterator to its end. Each starts from the same state, and the
  training RNG streams continue as if it had never run: the training loss
  curve does not depend on how often validation runs.
- Checkpoints carry every rank's training RNG state and training loader
  states (plain tensors and ints); ``fit(ckpt_path=...)`` checks them in
  full, refuses another world size, and gives each rank its own. With
  ``detctx.resumable_loader(...)`` a mid-epoch resume continues bit for bit.

Best-effort: random work before the ``setup`` hook (building the model, a
``LightningDataModule.setup`` that splits at random) is outside the callback.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import Unpack

from detctx._basics import (
    DEFAULT_SEED,
    DeterminismWarning,
    MissingDependencyError,
    resolve_seed,
    validate_seed,
    warn_at_user,
)
from detctx._blocks import deterministic
from detctx._state import Snapshot
from detctx._switches import SwitchOptions
from detctx.integrations._lightning_state import (
    STATE_FORMAT,
    STATE_VERSION,
    fit_loop_state,
    gather_every_rank,
    rank_entry,
    refuse_unreplayable,
    saved_seeds,
)

# DeterministicCallback is provided by the module's __getattr__, built on first use.
__all__ = ["FRAMEWORKS", "STATE_FORMAT", "DeterministicCallback", "callback_class"]  # noqa: F822

FRAMEWORKS = ("lightning.pytorch", "pytorch_lightning")
"""The Lightning packages the callback can be built for, preferred first."""

# The callback's warnings point past the Trainer's frames, at the user's line that led there.
_CALLERS = ("lightning", "pytorch_lightning", "lightning_fabric", "torch")

_classes: dict[str, type[Any]] = {}


def __getattr__(name: str) -> Any:
    # ``DeterministicCallback`` needs Lightning's ``Callback`` as its base, so it
    # is built on first use, for the Lightning package the program uses.
    if name == "DeterministicCallback":
        return callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def callback_class(framework: str | None = None) -> type[Any]:
    """``DeterministicCallback`` built on ``framework``'s ``Callback``.

    ``framework``: ``"lightning.pytorch"`` or ``"pytorch_lightning"``; by
    default the one already imported (``lightning.pytorch`` if both are),
    else the first one installed. Raises
    :class:`~detctx.MissingDependencyError` when neither is installed.
    """
    if framework is None:
        framework = _framework_in_use()
    elif framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    built = _classes.get(framework)
    if built is None:
        base = _import(framework).Callback
        built = type(
            "DeterministicCallback",
            (_DeterministicCallback, base),
            {
                "__module__": __name__,
                "__qualname__": "DeterministicCallback",
                "__doc__": _DeterministicCallback.__doc__,
                "framework": framework,
            },
        )
        _classes[framework] = built
    return built


def _framework_in_use() -> str:
    for name in FRAMEWORKS:
        if sys.modules.get(name) is not None:
            return name
    for name in FRAMEWORKS:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return name
    raise MissingDependencyError(
        "detctx.integrations.lightning needs Lightning: pip install 'detctx[lightning]' "
        "(or pip install lightning / pytorch-lightning)"
    )


def _import(framework: str) -> Any:
    try:
        return importlib.import_module(framework)
    except ImportError as exc:
        package = framework.split(".")[0].replace("_", "-")
        raise MissingDependencyError(
            f"{framework} is not installed ({exc}): pip install 'detctx[lightning]' "
            f"(or pip install {package})"
        ) from exc


def _rebuild(framework: str, config: dict[str, Any]) -> Any:
    """Unpickle a callback (``ddp_spawn`` sends it to each child): its configuration only."""
    return callback_class(framework)(**config)


# A fit resumed from a checkpoint saved just before a validation skips that validation, but
# ``increment_progress_to_evaluation_end`` still makes its loader's iterator, which draws a
# base seed from torch's stream (Lightning 2.6, training_epoch_loop.py, ``advance``).
_SCOPED_METHODS = ("run", "increment_progress_to_evaluation_end")


def _eval_loops(trainer: Any) -> list[Any]:
    """The trainer's loops that evaluate or predict (those it has, by attribute name)."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    candidates = [getattr(epoch_loop, "val_loop", None)] + [
        getattr(trainer, f"{name}_loop", None) for name in ("validate", "test", "predict")
    ]
    return [loop for loop in candidates if callable(getattr(loop, "run", None))]


class _DeterministicCallback:
    """Seed a Lightning run from ``seed``, evaluate in ``eval_seed``'s world, checkpoint the RNGs.

    ``seed``: an int in ``[0, 2**32 - 1]`` (default 1234), or ``None`` for
    ``$DETCTX_SEED`` if set, else a fresh seed, resolved once, here (with
    ``strategy="ddp"``, where each process builds its own callback, pass an
    int or set ``$DETCTX_SEED``). ``eval_seed``: the seed every validation,
    sanity check, test and predict loop starts from (default 0).
    ``**switches``: :class:`~detctx.SwitchOptions`, as for
    :class:`detctx.deterministic`. Bad values raise here. See
    :mod:`detctx.integrations.lightning`.
    """

    framework: str

    def __init__(
        self,
        seed: int | None = DEFAULT_SEED,
        eval_seed: int = 0,
        **switches: Unpack[SwitchOptions],
    ) -> None:
        self.seed = resolve_seed(None if seed is None else validate_seed(seed))
        self.eval_seed = validate_seed(eval_seed, "eval_seed")
        self._switches = dict(switches)
        self._run_block = deterministic(self.seed, **switches)
        self._eval_block = deterministic(self.eval_seed, **switches)
        self._open = False
        self._patched: list[tuple[Any, str]] = []
        # The training streams while an evaluation loop runs (checkpoints saved
        # then must hold them, not the evaluation's), and after the run ends.
        self._paused: list[Snapshot] = []
        self._last: Snapshot | None = None
        self._pending: Snapshot | None = None
        self._resumed = False
        self._reseed_checked = False
        self._checked_entry: tuple[Any, Snapshot] | None = None

    def __repr__(self) -> str:
        return f"DeterministicCallback(seed={self.seed}, eval_seed={self.eval_seed})"

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, dict[str, Any]]]:
        config = {"seed": self.seed, "eval_seed": self.eval_seed, **self._switches}
        return (_rebuild, (self.framework, config))

    @property
    def state_key(self) -> str:
        """The key of the callback's state in a checkpoint's ``"callbacks"``."""
        return "detctx.DeterministicCallback"

    # Lightning hooks.

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._open:
            return
        self._run_block.__enter__()
        self._open = True
        self._reseed_checked = False
        self._resumed = self._pending is not None
        try:
            # Set inside the run's block, which puts both back on exit (they are
            # among the variables every block watches: detctx._environment.variables.WATCHED).
            os.environ["PL_GLOBAL_SEED"] = str(self.seed)
            os.environ["PL_SEED_WORKERS"] = "1"
            for loop in _eval_loops(trainer):
                for name in _SCOPED_METHODS:
                    if callable(getattr(loop, name, None)):
                        setattr(loop, name, self._scoped(getattr(loop, name)))
                        self._patched.append((loop, name))
            if self._pending is not None:
                pending, self._pending = self._pending, None
                pending.restore()
        except BaseException:
            self._close()
            raise

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # LightningModule.setup runs after the callbacks' setup; a seed_everything there
        # reseeds every RNG and rewrites PL_GLOBAL_SEED, which ddp workers read.
        self._warn_if_reseeded(torch_seed=True)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._warn_if_reseeded()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._warn_if_reseeded()

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._warn_if_reseeded()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Called after Lightning restored the checkpoint (if any), whatever the strategy.
        if self._resumed:
            refuse_unreplayable(trainer)
        elif getattr(trainer, "ckpt_path", None) is not None:
            warn_at_user(
                f"the checkpoint {trainer.ckpt_path} holds no detctx RNG state (it was saved "
                f"without DeterministicCallback), so this run continues from seed {self.seed}, "
                "not from the RNG state of the run that saved it; resume from a checkpoint "
                "saved with DeterministicCallback for a bit-identical continuation",
                DeterminismWarning,
                through=_CALLERS,
            )

    def state_dict(self) -> dict[str, Any]:
        """This process's training RNG state (plain data), with the seeds it was reached from.

        In a checkpoint, ``on_save_checkpoint`` replaces ``"rng"`` by ``"ranks"``:
        every rank's RNG state and training loader states, by rank."""
        if self._paused:
            state = self._paused[-1]
        elif self._open or self._last is None:
            state = Snapshot.capture()
        else:
            state = self._last
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "seed": self.seed,
            "eval_seed": self.eval_seed,
            "rng": state.state_dict(),
        }

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        gather_every_rank(checkpoint, self.state_key)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        # Before Lightning restores its loops: this rank's loader states replace rank 0's.
        entry = checkpoint.get("callbacks", {}).get(self.state_key)
        if entry is not None:
            snapshot, loaders = self._checked(entry)
            self._checked_entry = (entry, snapshot)
            fit_state = fit_loop_state(checkpoint)
            if loaders is not None and fit_state is not None:
                fit_state["combined_loader"] = loaders

    def load_state_dict(self, state_dict: Any) -> None:
        """Check ``state_dict`` in full, then put this rank's RNG state in place (at
        ``setup`` if the run has not started). Raises :class:`~detctx.CheckpointError`,
        with nothing changed, for anything that is not such a state or that was saved
        by another number of processes."""
        checked, self._checked_entry = self._checked_entry, None
        if checked is not None and checked[0] is state_dict:
            snapshot = checked[1]
        else:
            snapshot = self._checked(state_dict)[0]
        self._resumed = True
        if self._open:
            snapshot.restore()
        else:
            self._pending = snapshot

    # Machinery.

    def _checked(self, state_dict: Any) -> tuple[Snapshot, Any]:
        """This rank's RNG snapshot and training loader states (``None``: not saved)."""
        where = f"the checkpoint's {self.state_key!r} entry"
        rng, loaders = rank_entry(state_dict, where)
        saved, snapshot = saved_seeds(state_dict, where), Snapshot.from_state_dict(rng)
        if saved != (self.seed, self.eval_seed):
            warn_at_user(
                f"resuming a run saved with seed={saved[0]}, eval_seed={saved[1]} under "
                f"DeterministicCallback(seed={self.seed}, eval_seed={self.eval_seed}): the "
                "training RNG state comes from the checkpoint, the evaluation seed from this "
                "callback; pass the seeds the run was started with to continue it exactly",
                DeterminismWarning,
                through=_CALLERS,
            )
        return snapshot, loaders

    def _warn_if_reseeded(self, *, torch_seed: bool = False) -> None:
        """Warn, once per stage, when the run's seed was changed since ``setup``.

        ``torch_seed``: also compare torch's seed (only outside the evaluation
        blocks, which seed ``eval_seed``)."""
        if self._reseed_checked or not self._open:
            return
        self._reseed_checked = True
        exported = os.environ.get("PL_GLOBAL_SEED")
        found = exported if exported != str(self.seed) else None
        # A resumed run's torch seed is the one its checkpoint was reached from.
        if found is None and torch_seed and not self._resumed and torch.initial_seed() != self.seed:
            found = str(torch.initial_seed())
        if found is None:
            return
        warn_at_user(
            f"the run's seed was changed from {self.seed} to {found} after "
            "DeterministicCallback seeded it (seed_everything or torch.manual_seed in "
            "LightningModule.setup or configure_model?): the run now follows that seed, "
            f"not DeterministicCallback(seed={self.seed}). Remove that call, or pass its "
            "seed to the callback",
            DeterminismWarning,
            through=_CALLERS,
        )

    def _scoped(self, run: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(run)
        def run_in_eval_block(*args: Any, **kwargs: Any) -> Any:
            self._paused.append(Snapshot.capture())
            try:
                with self._eval_block:
                    return run(*args, **kwargs)
            finally:
                self._paused.pop()

        return run_in_eval_block

    def _close(self) -> None:
        """Undo ``setup``: every part is attempted, the first error raised afterwards."""
        if not self._open:
            return
        self._open = False
        first_error: BaseException | None = None
        for loop, name in self._patched:
            try:
                delattr(loop, name)
            except AttributeError as exc:
                first_error = first_error or exc
        self._patched.clear()
        try:
            self._last = Snapshot.capture()
        finally:
            self._run_block.__exit__(None, None, None)
        if first_error is not None:
            raise first_error
