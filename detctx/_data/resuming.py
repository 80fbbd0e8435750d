"""Resume anywhere: a shuffled, multi-worker loader and the RNGs, in one checkpoint entry.

:func:`resumable_loader` builds a ``torchdata`` ``StatefulDataLoader`` (the
loader's position: sampler order, batches served, each worker's state) with
detctx's loader generator and worker seeding, and closes the two gaps that
loader leaves for bit-exact resumption:

- Its sampler saves the generator state from the *start* of the epoch and,
  on load, replays the epoch's permutation from it; the base seed the loader
  drew for its workers right after that permutation is restored as a number,
  not drawn again. So after a resume the generator stands one draw short of
  where it stood in the straight run, and every later epoch is shuffled
  differently. Reproduce (torchdata 0.11)::

      python -c "import torch; from torchdata.stateful_dataloader import StatefulDataLoader as L
      a = L(range(8), shuffle=True, generator=torch.Generator().manual_seed(0)); it = iter(a)
      next(it); s = a.state_dict(); list(it); e1 = list(a)
      b = L(range(8), shuffle=True, generator=torch.Generator().manual_seed(0))
      b.load_state_dict(s); list(b); print(e1 == list(b))"         # False

  The loader here keeps the generator state from right after the epoch's
  iterator was made, and puts it back once the resumed iterator is made.
- Workers' RNG streams are not saved; :class:`detctx._data.worker_streams.WorkerStreams`
  rides them in each worker's dataset state.

:func:`resume_state` and :func:`resume` put this process's RNG states
(:func:`detctx.capture`) and the loaders' positions in one plain dict, which
``torch.load(..., weights_only=True)`` reads back.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any, Final

import torch

from detctx._basics import CheckpointError, MissingDependencyError
from detctx._data.loader import current_rank, current_world_size, loader_generator, seed_worker
from detctx._data.loader_checks import (
    check_configuration,
    check_draws,
    check_position,
    describe_loader,
    generator_state,
)
from detctx._data.samplers import element_sampler, prepare_samplers
from detctx._data.worker_streams import WorkerStreams
from detctx._state import Snapshot, capture

__all__ = ["LOADER_FORMAT", "RESUME_FORMAT", "resumable_loader", "resume", "resume_state"]

LOADER_FORMAT: Final = "detctx.loader"
"""The ``"format"`` entry of a resumable loader's ``state_dict()``."""

RESUME_FORMAT: Final = "detctx.resume"
"""The ``"format"`` entry of :func:`resume_state`'s dict."""

_VERSION: Final = 1
_LOADER_VERSION: Final = 2  # 2: the configuration and the sampler's epoch are saved
_LOADER_KEYS: Final = frozenset(
    {"format", "version", "config", "loader", "generator", "generator_before", "epoch"}
)
_loader_class: type[Any] | None = None


def _stateful_dataloader() -> type[Any]:
    try:
        module = importlib.import_module("torchdata.stateful_dataloader")
    except ImportError as exc:
        raise MissingDependencyError(
            "resuming in the middle of an epoch needs torchdata's StatefulDataLoader: "
            f"pip install 'detctx[resume]' (or pip install torchdata>=0.8) ({exc})"
        ) from exc
    loader: type[Any] = module.StatefulDataLoader
    return loader


def resumable_loader(dataset: Any, *args: Any, seed: int | None = None, **kwargs: Any) -> Any:
    """A ``DataLoader`` whose position and workers' RNG streams go in a checkpoint.

    Takes ``DataLoader``'s arguments (``batch_size=8, shuffle=True,
    num_workers=2, collate_fn=...``) and returns a ``torchdata``
    ``StatefulDataLoader`` (``pip install 'detctx[resume]'``) with:

    - ``generator=detctx.loader_generator(seed)`` unless one is given: the
      order and the workers' base seeds come from ``seed`` (or the
      enclosing block's seed when ``seed`` is ``None``) and this rank;
    - ``worker_init_fn=detctx.seed_worker`` unless one is given;
    - the dataset wrapped so that each worker's RNG states (Python, NumPy,
      torch CPU, registered sources) are part of the loader's state.

    ``state_dict()`` holds the sampler's position, each worker's streams
    after the last batch the main process took from it, and the generator as
    it stood after the current epoch's order was drawn; ``load_state_dict()``
    makes the next ``iter()`` continue that epoch where it stopped, and
    later epochs shuffle as they would have. Use it through
    :func:`resume_state` / :func:`resume`, or hand it to a framework that
    saves loaders with ``state_dict`` (Lightning 2.3+).

    The dataset must be map-style (``TypeError`` otherwise), and
    ``in_order=False`` is refused (``ValueError``): out-of-order batches have
    no position to resume from.
    """
    if kwargs.get("in_order", True) is not True:
        raise ValueError(
            "resumable_loader needs in_order=True (the default): with in_order=False, "
            "batches arrive in the order workers finish them, so no saved position "
            "resumes the same sequence"
        )
    streams = WorkerStreams(dataset)
    if kwargs.get("generator") is None:
        kwargs["generator"] = loader_generator(seed)
    elif seed is not None:
        raise TypeError("pass either seed= or generator= to resumable_loader, not both")
    if kwargs.get("worker_init_fn") is None:
        kwargs["worker_init_fn"] = seed_worker
    loader_class = _class()
    prepare_samplers(kwargs)
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital on every construction, which torch 2.13
        # deprecates: python -W error -c "from torchdata.stateful_dataloader import
        # StatefulDataLoader as L; L([1])"   (UserWarning: 'set_vital' is deprecated)
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return loader_class(streams, *args, **kwargs)


def resume_state(*loaders: Any) -> dict[str, Any]:
    """Everything a run needs to continue exactly from here, as one plain dict.

    ``{"format": "detctx.resume", "version": 1, "rng": ..., "loaders": [...]}``:
    every RNG of this process (``detctx.capture().state_dict()``) and each
    loader's ``state_dict()`` (its position, and the configuration and rank it
    was saved with, which :func:`resume` checks). Save it with the model and
    optimiser, one file per rank; it loads with
    ``torch.load(..., weights_only=True)``::

        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "detctx": detctx.resume_state(loader)}, path)
    """
    _check_loaders(loaders)
    return {
        "format": RESUME_FORMAT,
        "version": _VERSION,
        "rng": capture().state_dict(),
        "loaders": [loader.state_dict() for loader in loaders],
    }


def resume(state: Mapping[str, Any], *loaders: Any, strict: bool = True) -> None:
    """Continue from :func:`resume_state`'s dict: every RNG now, each loader at its next ``iter()``.

    ``loaders`` are the same loaders, in the same order, built the same way
    as in the run that saved ``state``. Everything is checked first, and
    :class:`~detctx.CheckpointError` is raised with nothing changed (RNGs and
    loaders alike) for: a dict of another format or version; a different
    number of loaders, or one loader passed twice; a loader in the middle of
    an epoch (an iterator of it is live); a loader built differently (its
    ``num_workers``, batch size, ``drop_last``, dataset length or sampler) or
    on another rank or world size than the one that saved the state, named
    in the message; any count, seed or RNG state of a loader's position that
    this loader cannot have reached; RNG states that do not fit this
    process's sources (see :meth:`detctx.Snapshot.from_state_dict`;
    ``strict=False`` skips sources either side lacks). If restoring an RNG
    raises, the loaders are put back as they were too::

        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        detctx.resume(checkpoint["detctx"], loader)
    """
    _check_loaders(loaders)
    if not isinstance(state, Mapping) or state.get("format") != RESUME_FORMAT:
        raise CheckpointError(
            f"not a detctx resume state (no 'format': {RESUME_FORMAT!r} entry); pass the dict "
            "detctx.resume_state() returned"
        )
    if state.get("version") != _VERSION:
        raise CheckpointError(
            f"the resume state has version {state.get('version')!r}; this detctx reads version "
            f"{_VERSION}: resume with the detctx version that saved it"
        )
    saved = state.get("loaders")
    if not isinstance(saved, list) or len(saved) != len(loaders):
        count = len(saved) if isinstance(saved, list) else "no"
        raise CheckpointError(
            f"the resume state holds {count} loader state(s) but {len(loaders)} loader(s) were "
            "passed: pass the loaders the run was saved with, in the same order"
        )
    if not isinstance(state.get("rng"), Mapping):
        raise CheckpointError(
            f"the resume state's 'rng' is {type(state.get('rng')).__name__}, not the dict of RNG "
            "states resume_state saves"
        )
    snapshot = Snapshot.from_state_dict(state["rng"], strict=strict)
    for index, (loader, loader_state) in enumerate(zip(loaders, saved)):
        loader.check_state(loader_state, where=f"state['loaders'][{index}]")
    pending = [loader.pending() for loader in loaders]
    try:
        for loader, loader_state in zip(loaders, saved):
            loader.load_checked(loader_state)
        snapshot.restore()  # atomic: a source that raises leaves every RNG as it was
    except BaseException:
        for loader, before in zip(loaders, pending):
            loader.put_back(before)
        raise


def _check_loaders(loaders: tuple[Any, ...]) -> None:
    for index, loader in enumerate(loaders):
        if _loader_class is None or not isinstance(loader, _loader_class):
            raise TypeError(
                f"{type(loader).__name__} is not a resumable loader, so its position cannot be "
                "saved and checked: build it with detctx.resumable_loader(dataset, ...)"
            )
        first = next(i for i, other in enumerate(loaders) if other is loader)
        if first != index:
            raise CheckpointError(
                f"the same loader is passed twice (loaders {first} and {index}); each loader "
                "has one position: pass each once, in the order they were saved"
            )


def _class() -> type[Any]:
    global _loader_class
    if _loader_class is None:
        _loader_class = _build_class(_stateful_dataloader())
    return _loader_class


def _build_class(base: Any) -> type[Any]:
    class ResumableLoader(base):  # type: ignore[misc]
        """A ``torchdata`` ``StatefulDataLoader`` that resumes bit for bit, or refuses a
        state it cannot resume exactly: see ``detctx.resumable_loader``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # The generator as it stood right after this epoch's iterator was made
            # (the order and the workers' base seed drawn), and the one to put back
            # when the iterator of a loaded state is made; the same for the epoch of
            # a sampler that has one (DistributedSampler), which set_epoch changes.
            self._generator_at_start: torch.Tensor | None = None
            self._generator_to_restore: torch.Tensor | None = None
            # ... and as it stood before them, from which resume() replays the draws
            # to check the saved states and base seed follow from each other.
            self._generator_before: torch.Tensor | None = None
            self._before_to_restore: torch.Tensor | None = None
            self._iterators_made = 0
            self._epoch_at_start: int | None = None
            self._epoch_to_restore: int | None = None
            # The rank that built the loader: its generator and shard are that rank's.
            self._placement = (current_rank(), current_world_size())

        def configuration(self) -> dict[str, Any]:
            """What decides the batches and where, as saved in ``state_dict()['config']``."""
            return describe_loader(self, *self._placement)

        def state_dict(self) -> dict[str, Any]:
            position = super().state_dict()
            generator = self._generator_at_start
            if generator is None and self.generator is not None:
                generator = self.generator.get_state()
            return {
                "format": LOADER_FORMAT,
                "version": _LOADER_VERSION,
                "config": self.configuration(),
                "loader": position,
                "generator": generator,
                "generator_before": self._generator_before,
                "epoch": self._epoch_at_start,
            }

        def check_state(self, state: Any, where: str = "the loader state") -> None:
            """Raise :class:`~detctx.CheckpointError` unless this loader resumes ``state``
            exactly."""
            if not isinstance(state, Mapping) or state.get("format") != LOADER_FORMAT:
                raise CheckpointError(
                    f"{where} was not saved by a detctx resumable loader (no 'format': "
                    f"{LOADER_FORMAT!r} entry)"
                )
            if state.get("version") != _LOADER_VERSION:
                raise CheckpointError(
                    f"{where} has version {state.get('version')!r}; this detctx reads loader "
                    f"states of version {_LOADER_VERSION}: resume with the detctx that saved it"
                )
            if set(state) != _LOADER_KEYS:
                raise CheckpointError(
                    f"{where} holds keys {sorted(map(str, state))}; a resumable loader saves "
                    f"{sorted(_LOADER_KEYS)}"
                )
            iterator = self._iterator
            if iterator is not None and not self._initial_iter_for_state_dict:
                if not iterator._finished:
                    raise CheckpointError(
                        "this loader is in the middle of an epoch (an iterator of it is live), "
                        "which a loaded position would silently replace: call detctx.resume "
                        "before iterating the loader"
                    )
            config = self.configuration()
            check_configuration(state["config"], config, where)
            for key in ("generator", "generator_before"):
                if self.generator is None:
                    if state[key] is not None:
                        raise CheckpointError(f"{where}[{key!r}] is set; this loader has none")
                else:
                    generator_state(state[key], f"{where}[{key!r}]")
            epoch = state["epoch"]
            if hasattr(element_sampler(self), "set_epoch"):
                if type(epoch) is not int or epoch < 0:
                    raise CheckpointError(
                        f"{where}['epoch'] is {epoch!r}; the sampler's epoch is an int >= 0"
                    )
            elif epoch is not None:
                raise CheckpointError(f"{where}['epoch'] is {epoch!r}; this sampler has none")
            check_position(self, state["loader"], config, f"{where}['loader']")
            check_draws(self, state, where)

        def load_state_dict(self, state: Mapping[str, Any]) -> None:
            self.check_state(state)
            self.load_checked(state)

        def load_checked(self, state: Mapping[str, Any]) -> None:
            """Load a state :meth:`check_state` accepted."""
            super().load_state_dict(dict(state["loader"]))
            self._generator_to_restore = state["generator"]
            self._before_to_restore = state["generator_before"]
            self._epoch_to_restore = state["epoch"]
            if state["epoch"] is not None:
                element_sampler(self).set_epoch(state["epoch"])

        def pending(self) -> tuple[Any, ...]:
            """What a load changes, for :meth:`put_back`."""
            return (
                self.next_iter_state,
                self._iterator,
                self._initial_iter_for_state_dict,
                self._generator_to_restore,
                self._before_to_restore,
                self._epoch_to_restore,
                getattr(element_sampler(self), "epoch", None),
            )

        def put_back(self, before: tuple[Any, ...]) -> None:
            """Undo a load: what :meth:`pending` returned before it."""
            (
                self.next_iter_state,
                self._iterator,
                self._initial_iter_for_state_dict,
                self._generator_to_restore,
                self._before_to_restore,
                self._epoch_to_restore,
                epoch,
            ) = before
            if epoch is not None:
                element_sampler(self).set_epoch(epoch)

        def _get_iterator(self) -> Any:
            resuming = self.next_iter_state is not None
            epoch = getattr(element_sampler(self), "epoch", None)
            if resuming and self._epoch_to_restore not in (None, epoch):
                raise CheckpointError(
                    f"the loader was resumed in epoch {self._epoch_to_restore} of its sampler, "
                    f"but set_epoch({epoch}) was called before its first iter(): call "
                    f"set_epoch({self._epoch_to_restore}) (or nothing) until that epoch ends"
                )
            self._iterators_made += 1
            before = self._generator_state()
            iterator = super()._get_iterator()
            if resuming and self._generator_to_restore is not None and self.generator is not None:
                self.generator.set_state(self._generator_to_restore)
                before = self._before_to_restore
            self._generator_before = before
            self._generator_to_restore = self._before_to_restore = None
            self._epoch_to_restore = None
            self._record_start()
            return iterator

        def __iter__(self) -> Any:
            made, before = self._iterators_made, self._generator_state()
            iterator = super().__iter__()
            # Persistent workers start an epoch without a new iterator (the old one is
            # reset, which draws the order but no new base seed).
            after = self._generator_state()
            if made == self._iterators_made and not _same(before, after):
                self._generator_before = before
            self._record_start()
            return iterator

        def _generator_state(self) -> torch.Tensor | None:
            return None if self.generator is None else self.generator.get_state()

        def _record_start(self) -> None:
            if self.generator is not None:
                self._generator_at_start = self.generator.get_state()
            self._epoch_at_start = getattr(element_sampler(self), "epoch", None)

    ResumableLoader.__module__ = __name__
    ResumableLoader.__qualname__ = "ResumableLoader"
    return ResumableLoader


def _same(first: torch.Tensor | None, second: torch.Tensor | None) -> bool:
    if first is None or second is None:
        return first is second
    return torch.equal(first, second)
