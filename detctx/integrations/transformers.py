"""Hugging Face ``Trainer``: every evaluation scoped to its own seed.

``Trainer.train()`` runs evaluation in the middle of training, and a random
eval pipeline (``DataCollatorForLanguageModeling``'s masking, a shuffled or
multi-worker eval ``DataLoader``, a model that samples) draws from the
training RNG streams: the training loss curve then depends on ``eval_steps``.
:class:`DeterministicCallback` runs each evaluation inside a
``detctx.deterministic(seed=eval_seed)`` block, so evaluation neither moves
the training streams nor depends on where in training it runs. It also
collates each training batch in a world keyed by the batch, so that
``train(resume_from_checkpoint=...)`` from a checkpoint in the middle of an
epoch continues bit for bit (see :class:`DeterministicCallback`).

Importing this module imports transformers; without it, it raises
:class:`~detctx.MissingDependencyError` naming the extra to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from typing_extensions import Unpack

from detctx._basics import DeterminismWarning, MissingDependencyError, warn_at_user
from detctx._blocks import deterministic, open_blocks
from detctx._data import KeyedCollate
from detctx._switches import SwitchOptions

__all__ = ["DeterministicCallback"]

# The callback's warnings point past the Trainer's frames, at the user's line that led there.
_CALLERS = ("transformers", "accelerate", "torch")


def _load_transformers() -> Any:
    # Through importlib, so that mypy does not type-check all of transformers (it
    # ships py.typed) and so that the error below can say what to install.
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise MissingDependencyError(
            "detctx.integrations.transformers needs Hugging Face transformers: "
            f"pip install 'detctx[transformers]' ({exc})"
        ) from exc


_TrainerCallback: Any = _load_transformers().TrainerCallback


class DeterministicCallback(_TrainerCallback):  # type: ignore[misc]
    """A ``transformers.TrainerCallback`` that scopes every evaluation to ``eval_seed``.

    Each evaluation that ``Trainer.train()`` runs (``eval_strategy="steps"``
    or ``"epoch"``, ``eval_on_start``) runs inside
    ``detctx.deterministic(seed=eval_seed, **switches)``: on entry every RNG,
    the determinism flags and variables are saved, every RNG is seeded with
    ``eval_seed`` and determinism is switched on; after the evaluation all of
    it is restored exactly. So the training loss curve is the same bit for
    bit whatever ``eval_steps`` is (or with evaluation off), and each
    evaluation draws the same masks, worker seeds and samples on every run::

        from detctx.integrations.transformers import DeterministicCallback

        trainer = Trainer(model=model, args=args, train_dataset=train_ds,
                          eval_dataset=eval_ds, data_collator=collator,
                          callbacks=[DeterministicCallback(eval_seed=0)])
        trainer.train()

    ``eval_seed`` and ``switches`` are those of :class:`detctx.deterministic`
    and are validated here. ``trainer.evaluate()`` and ``trainer.predict()``
    called directly start without any callback event, so the callback cannot
    scope them; wrap such a call in ``with detctx.deterministic(seed=0):``
    (the callback warns, with :class:`~detctx.DeterminismWarning`,
    when one ends outside any detctx block). The same holds for each eval
    dataset after the first when ``eval_dataset`` is a dict. If an evaluation
    raises, its block stays open (holding detctx's lock) until the next
    ``train()`` or :meth:`close`.

    With ``resumable=True`` (the default) the training loader's collator
    runs, for each batch, in a world of its own: every registered RNG source
    seeded from ``args.seed``, the epoch and the batch's contents, and put
    back afterwards. The Trainer fetches a batch ahead of the step that uses
    it and, on resume, builds the first batches before it reloads
    ``rng_state.pth``, so a random collator (``DataCollatorForLanguageModeling``)
    drawing from the training streams cannot resume exactly; keyed by the
    batch, its masks are the same in the straight and the resumed run, the
    training streams hold only the model's draws, and
    ``trainer.train(resume_from_checkpoint=...)`` from a checkpoint saved in
    the middle of an epoch continues bit for bit, with loader workers or
    without. ``resumable=False`` leaves the collator alone.
    """

    def __init__(
        self,
        eval_seed: int | None = 0,
        *,
        resumable: bool = True,
        **switches: Unpack[SwitchOptions],
    ) -> None:
        if not isinstance(resumable, bool):
            raise TypeError(f"resumable must be True or False, got {resumable!r}")
        self._block = deterministic(seed=eval_seed, **switches)
        self._open = False
        self.resumable = resumable
        self._collate: KeyedCollate | None = None

    @property
    def eval_seed(self) -> int | None:
        """The seed every evaluation starts from (``None``: resolved per evaluation)."""
        return self._block.seed

    def __repr__(self) -> str:
        return f"DeterministicCallback({self._block!r})"

    # No callback event precedes an evaluation: Trainer calls on_evaluate only
    # after its last batch. Inside train() the evaluation is decided by
    # control.should_evaluate, which DefaultFlowCallback (always first in the
    # callback list) sets in on_step_end / on_epoch_end, and which
    # Trainer._maybe_log_save_evaluate acts on right after those events, before
    # the eval DataLoader is iterated (only on_log, which draws nothing, comes
    # between). So the block is entered there and exited in on_evaluate, which
    # comes before the checkpoint that follows an evaluation saves rng_state.pth:
    # the checkpoint holds the training streams, not the evaluation's. The order
    # (transformers 4.x and 5.x) shows in:
    #   python -c "import inspect, transformers as t;
    #              print(inspect.getsource(t.Trainer._maybe_log_save_evaluate))"
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()
        self._collate = None
        if self.resumable:
            self._collate = _key_collate(kwargs.get("train_dataloader"), int(args.seed))
        if getattr(args, "eval_on_start", False):
            self._enter()

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Before the epoch's loader iterator (and its workers) is made. With persistent
        # workers, the workers keep the epoch they started with: leave it out of the key.
        if self._collate is not None and not getattr(args, "dataloader_persistent_workers", False):
            self._collate.epoch = int(state.epoch or 0)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_evaluate:
            self._enter()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_evaluate:
            self._enter()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._open:
            self.close()
        else:
            self._warn_unscoped("an evaluation", "trainer.evaluate()")

    def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._warn_unscoped("a prediction", "trainer.predict(test_dataset)")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Exit an evaluation's block that is still open (one that raised), restoring
        what was saved when it was entered; does nothing when none is open."""
        if self._open:
            self._open = False
            self._block.__exit__(None, None, None)

    def _enter(self) -> None:
        if not self._open:
            self._block.__enter__()
            self._open = True

    def _warn_unscoped(self, what: str, call: str) -> None:
        if open_blocks():
            return
        seed = self._block.seed
        warn_at_user(
            f"{what} ran outside DeterministicCallback's scope (called directly, or an eval "
            "dataset after the first of a dict): its random draws came from, and moved, "
            f"the caller's RNG streams. Wrap the call: with detctx.deterministic(seed={seed}): "
            f"{call}",
            DeterminismWarning,
            through=_CALLERS,
        )


def _key_collate(loader: Any, seed: int) -> KeyedCollate | None:
    """Wrap the collator of the Trainer's training loader in a :class:`KeyedCollate`.

    The Trainer's loader is accelerate's ``DataLoaderShard``, which iterates
    the ``DataLoader`` it wraps (``base_dataloader``) and hands its own
    attributes to ``accelerate.skip_first_batches`` on resume: both get the
    wrapper.
    """
    if loader is None or getattr(loader, "collate_fn", None) is None:
        return None
    collate = loader.collate_fn
    if isinstance(collate, KeyedCollate):
        return collate
    keyed = KeyedCollate(collate, seed)
    base = getattr(loader, "base_dataloader", None)
    if base is not None:
        base.collate_fn = keyed
    loader.collate_fn = keyed
    return keyed
