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

from detctx._basics import (
    CheckpointError,
    DeterminismWarning,
    MissingDependencyError,
    warn_at_user,
)
from detctx._blocks import deterministic, open_blocks
from detctx._data import KEYED_STREAMS_VERSION, ElasticLoader, KeyedCollate, loader_generator
from detctx._switches import SwitchOptions
from detctx.integrations._ranks import rank_and_world

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


_transformers = _load_transformers()
_TrainerCallback: Any = _transformers.TrainerCallback
# Its state() goes in trainer_state.json where transformers has ExportableState.
_ExportableState: Any = getattr(_transformers.trainer_callback, "ExportableState", object)


class DeterministicCallback(_TrainerCallback, _ExportableState):  # type: ignore[misc]
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

    A resume with another world size, another training dataset length or
    another number of batches an epoch (the Trainer skips the trained batches
    by count) raises :class:`~detctx.CheckpointError` in ``on_train_begin``,
    before any step.
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
        self._switches = dict(switches)
        self._open = False
        self.resumable = resumable
        self._collate: KeyedCollate | None = None
        self._persistent = False
        # The training data's (samples, batches an epoch), for the checkpoint: known from
        # on_train_begin on (None before, and for data without a length).
        self._data: tuple[int | None, int | None] = (None, None)

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
    def state(self) -> dict[str, Any]:
        """What ``trainer_state.json`` keeps of the callback: its arguments and the world
        size, which a resumed run must have (each rank's ``rng_state_<rank>.pth`` and data
        shard belong to it)."""
        arguments = {"eval_seed": self.eval_seed, "resumable": self.resumable, **self._switches}
        samples, batches = self._data
        attributes = {
            "saved_world_size": _world_size(),
            "saved_samples": samples,
            "saved_batches": batches,
            "keyed_streams": KEYED_STREAMS_VERSION,
        }
        return {"args": arguments, "attributes": attributes}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Every refusal comes before anything changes: the Trainer skips the trained batches
        # by count alone, and only this event sees both the saved state and the new loader.
        loader = kwargs.get("train_dataloader")
        saved = _saved_attributes(state)
        _refuse_other_world_size(saved)
        data = _data_sizes(loader)
        _refuse_other_data(saved, data)
        if self.resumable or isinstance(loader, ElasticLoader):
            _refuse_other_keyed_streams(saved)
        self._data = data
        self.close()
        self._collate = None
        self._persistent = _persistent_workers(args)
        if self.resumable:
            self._collate = _key_collate(loader, int(args.seed))
            if self._persistent:
                _own_base_seeds(loader, int(args.seed), int(args.process_index))
        if getattr(args, "eval_on_start", False):
            self._enter(kwargs)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Before the epoch's loader iterator (and its workers) is made. With persistent
        # workers, the workers keep the epoch they started with: leave it out of the key.
        if self._collate is not None and not getattr(args, "dataloader_persistent_workers", False):
            self._collate.epoch = int(state.epoch or 0)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_evaluate:
            self._enter(kwargs)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if control.should_evaluate:
            self._enter(kwargs)

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

    def _enter(self, events: dict[str, Any]) -> None:
        if not self._open:
            if self._persistent:
                _restart_workers(events.get("eval_dataloader"))
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


def _world_size() -> int:
    return rank_and_world()[1]


def _saved_attributes(state: Any) -> dict[str, Any]:
    """What the checkpoint being resumed saved of this callback (empty: a fresh run, or a
    checkpoint saved without it)."""
    saved = (getattr(state, "stateful_callbacks", None) or {}).get("DeterministicCallback")
    saved = saved[0] if isinstance(saved, list) and saved else saved
    attributes = saved.get("attributes") if isinstance(saved, dict) else None
    return attributes if isinstance(attributes, dict) else {}


def _refuse_other_world_size(saved: dict[str, Any]) -> None:
    """Raise :class:`~detctx.CheckpointError` when a resumed ``TrainerState`` was saved by
    another number of processes. The Trainer itself warns and goes on: it looks for
    ``rng_state_<rank>.pth`` (or ``rng_state.pth`` alone), and the sampler shards the
    data for the new world size, so the resumed run reads other batches."""
    world = saved.get("saved_world_size")
    if world is None or world == _world_size():
        return
    raise CheckpointError(
        f"the checkpoint was saved by {world} process(es) (world size {world}) and is resumed "
        f"by {_world_size()} (this is rank {rank_and_world()[0]}): each rank's "
        "rng_state_<rank>.pth and data shard belong to the world size that saved them. "
        f"Resume with {world} process(es), or start a new run from the checkpoint's weights"
    )


def _data_sizes(loader: Any) -> tuple[int | None, int | None]:
    """The training loader's dataset length and batches an epoch (``None``: no length)."""

    def size(value: Any) -> int | None:
        try:
            return len(value)
        except (TypeError, NotImplementedError, AttributeError):
            return None

    if loader is None:
        return None, None
    return size(getattr(loader, "dataset", None)), size(loader)


def _refuse_other_data(saved: dict[str, Any], data: tuple[int | None, int | None]) -> None:
    """Raise :class:`~detctx.CheckpointError` when the checkpoint was saved training on a
    dataset of another length, or with another number of batches an epoch (another batch
    size, ``drop_last``). The Trainer skips ``global_step`` batches by count, without
    looking at what they were: on other data, the resumed run reads other samples than the
    straight one would, epochs begin elsewhere, and nothing says so (a resumable or elastic
    loader of detctx refuses a dataset of another length the same way)."""
    samples, batches = data
    found = (
        ("saved_samples", samples, "trained on a dataset of {} samples", "dataset has {}"),
        ("saved_batches", batches, "saved with {} training batches an epoch", "loader has {}"),
    )
    for entry, now, then_text, now_text in found:
        then = saved.get(entry)
        if then is not None and now is not None and then != now:
            raise CheckpointError(
                f"the checkpoint was {then_text.format(then)}; this run's training "
                f"{now_text.format(now)}: the Trainer would skip the batches trained by count, "
                "read other samples and start the epochs elsewhere, and go on as if resumed. "
                "Resume with the dataset and batch size the checkpoint was saved with, or "
                "start a new run from the checkpoint's weights"
            )


def _refuse_other_keyed_streams(saved: dict[str, Any]) -> None:
    """Raise :class:`~detctx.CheckpointError` when the checkpoint's keyed streams (the keyed
    collator's masks, an elastic loader's samples) were seeded another way: the Trainer would
    go on with draws the saved run never made, bit-exactness lost without a word."""
    if not saved:
        return
    version = saved.get("keyed_streams", 1)
    if version != KEYED_STREAMS_VERSION:
        raise CheckpointError(
            f"the checkpoint's keyed streams are version {version!r} (1: seeded from 32 bits, "
            f"by a detctx before 64-bit seeds); this detctx seeds them as version "
            f"{KEYED_STREAMS_VERSION}, so the resumed run would collate and augment with "
            "other draws than the saved run's continuation. Resume with the detctx that saved "
            "it, or start a new run from the checkpoint's weights"
        )


def _persistent_workers(args: Any) -> bool:
    workers = getattr(args, "dataloader_num_workers", 0)
    return bool(getattr(args, "dataloader_persistent_workers", False)) and bool(workers)


def _own_base_seeds(loader: Any, seed: int, rank: int) -> None:
    """Give the training ``DataLoader`` a generator of its own for its workers' base seed.

    Without one, the base seed is drawn from torch's stream when the loader's
    iterator is made: once, in the first epoch, with persistent workers; but a
    run resumed in a later epoch makes it again at the next epoch (the resumed
    epoch ran on the loader ``skip_first_batches`` built), one draw more from
    the training stream than the straight run, and every later dropout mask
    differs (transformers 5.24, accelerate 1.15: equal until the next epoch
    boundary, then up to 0.021 apart).
    """
    base = getattr(loader, "base_dataloader", loader)
    if base is not None and getattr(base, "generator", None) is None:
        base.generator = loader_generator(seed, rank=rank)


def _restart_workers(loader: Any) -> None:
    """Shut down the persistent workers of the evaluation loader before an evaluation.

    Persistent workers keep their RNG streams from one evaluation to the next,
    so a random eval collator's masks depend on how many evaluations came
    before, and a resumed run (whose eval loader starts afresh) evaluates with
    other masks (measured: eval losses up to 0.051 apart). Started afresh inside
    the evaluation's block, the workers are seeded from ``eval_seed`` each time.
    """
    base = getattr(loader, "base_dataloader", loader)
    # torch's DataLoader keeps a persistent iterator in ``_iterator`` and makes a new one,
    # with new workers and a new base seed, when it is None (torch/utils/data/dataloader.py).
    if base is not None and getattr(base, "_iterator", None) is not None:
        base._iterator = None


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
