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

from detctx._basics import CheckpointError, MissingDependencyError, open_envelope
from detctx._data.loader import loader_generator, seed_worker
from detctx._data.worker_streams import WorkerStreams
from detctx._state import Snapshot, capture

__all__ = ["LOADER_FORMAT", "RESUME_FORMAT", "resumable_loader", "resume", "resume_state"]

LOADER_FORMAT: Final = "detctx.loader"
"""The ``"format"`` entry of a resumable loader's ``state_dict()``."""

RESUME_FORMAT: Final = "detctx.resume"
"""The ``"format"`` entry of :func:`resume_state`'s dict."""

_VERSION: Final = 1
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
    loader's ``state_dict()``. Save it with the model and optimiser; it
    loads with ``torch.load(..., weights_only=True)``::

        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "detctx": detctx.resume_state(loader)}, path)
    """
    for loader in loaders:
        _check_stateful(loader)
    return {
        "format": RESUME_FORMAT,
        "version": _VERSION,
        "rng": capture().state_dict(),
        "loaders": [loader.state_dict() for loader in loaders],
    }


def resume(state: Mapping[str, Any], *loaders: Any, strict: bool = True) -> None:
    """Continue from :func:`resume_state`'s dict: every RNG now, each loader at its next ``iter()``.

    ``loaders`` are the same loaders, in the same order, built the same way
    as in the run that saved ``state``. Everything is checked first: a dict
    of another format or version, a different number of loaders, a loader
    state that is not a resumable loader's, or RNG states that do not fit
    this process's sources (see :meth:`detctx.Snapshot.from_state_dict`;
    ``strict=False`` skips sources either side lacks) raise
    :class:`~detctx.CheckpointError` with nothing changed::

        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        detctx.resume(checkpoint["detctx"], loader)
    """
    for loader in loaders:
        _check_stateful(loader)
    state = open_envelope(
        state,
        RESUME_FORMAT,
        _VERSION,
        what="the resume state",
        refusal="not a detctx resume state",
        hint="pass the dict detctx.resume_state() returned",
    )
    saved = state.get("loaders")
    if not isinstance(saved, list) or len(saved) != len(loaders):
        count = len(saved) if isinstance(saved, list) else "no"
        raise CheckpointError(
            f"the resume state holds {count} loader state(s) but {len(loaders)} loader(s) were "
            "passed: pass the loaders the run was saved with, in the same order"
        )
    snapshot = Snapshot.from_state_dict(state.get("rng", {}), strict=strict)
    for loader, loader_state in zip(loaders, saved):
        checker = getattr(loader, "check_state", None)
        if checker is not None:
            checker(loader_state)
    for loader, loader_state in zip(loaders, saved):
        loader.load_state_dict(loader_state)
    snapshot.restore()


def _check_stateful(loader: Any) -> None:
    methods = (getattr(loader, "state_dict", None), getattr(loader, "load_state_dict", None))
    if not all(callable(method) for method in methods):
        raise TypeError(
            f"{type(loader).__name__} has no state_dict/load_state_dict, so its position cannot be "
            "saved: build it with detctx.resumable_loader(dataset, ...)"
        )


def _class() -> type[Any]:
    global _loader_class
    if _loader_class is None:
        _loader_class = _build_class(_stateful_dataloader())
    return _loader_class


def _build_class(base: Any) -> type[Any]:
    class ResumableLoader(base):  # type: ignore[misc]
        """A ``torchdata`` ``StatefulDataLoader`` that resumes bit for bit: see
        ``detctx.resumable_loader``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # The generator as it stood right after this epoch's iterator was made
            # (the order and the workers' base seed drawn), and the one to put back
            # when the iterator of a loaded state is made.
            self._generator_at_start: torch.Tensor | None = None
            self._generator_to_restore: torch.Tensor | None = None

        def state_dict(self) -> dict[str, Any]:
            position = super().state_dict()
            generator = self._generator_at_start
            if generator is None and self.generator is not None:
                generator = self.generator.get_state()
            return {
                "format": LOADER_FORMAT,
                "version": _VERSION,
                "loader": position,
                "generator": generator,
            }

        def check_state(self, state: Any) -> None:
            """Raise :class:`~detctx.CheckpointError` unless ``state`` is this loader's kind."""
            state = open_envelope(
                state,
                LOADER_FORMAT,
                _VERSION,
                what="the loader state",
                refusal="the loader state was not saved by a detctx resumable loader",
            )
            generator = state.get("generator")
            if self.generator is not None and generator is not None:
                expected = self.generator.get_state()
                if (
                    not isinstance(generator, torch.Tensor)
                    or generator.dtype != expected.dtype
                    or generator.shape != expected.shape
                ):
                    raise CheckpointError(
                        "the loader state's generator state does not fit this loader's generator "
                        f"(a {expected.dtype} tensor of shape {tuple(expected.shape)})"
                    )
            if not isinstance(state.get("loader"), Mapping):
                raise CheckpointError("the loader state has no 'loader' position")

        def load_state_dict(self, state: Mapping[str, Any]) -> None:
            self.check_state(state)
            super().load_state_dict(dict(state["loader"]))
            self._generator_to_restore = state["generator"]

        def _get_iterator(self) -> Any:
            resuming = self.next_iter_state is not None
            iterator = super()._get_iterator()
            if resuming and self._generator_to_restore is not None and self.generator is not None:
                self.generator.set_state(self._generator_to_restore)
            self._generator_to_restore = None
            self._record_start()
            return iterator

        def __iter__(self) -> Any:
            iterator = super().__iter__()
            # Persistent workers start an epoch without a new iterator (the old one is reset).
            self._record_start()
            return iterator

        def _record_start(self) -> None:
            if self.generator is not None:
                self._generator_at_start = self.generator.get_state()

    ResumableLoader.__module__ = __name__
    ResumableLoader.__qualname__ = "ResumableLoader"
    return ResumableLoader
