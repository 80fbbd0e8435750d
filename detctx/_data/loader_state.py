"""The loader ``resumable_loader`` returns: a ``torchdata`` ``StatefulDataLoader`` whose state also
holds the configuration it was saved with and the generator's draws, and which checks a state in
full before loading it (see :mod:`detctx._data.loader_checks`) and can undo a load.

The class is built on first use, so that ``torchdata`` is imported only then.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Final

import torch

from detctx._basics import CheckpointError, MissingDependencyError, open_envelope
from detctx._data.loader import current_rank, current_world_size
from detctx._data.loader_checks import (
    check_configuration,
    check_draws,
    check_position,
    describe_loader,
)
from detctx._data.samplers import element_sampler
from detctx._data.untrusted import digest, generator_state, same_plain

__all__ = ["LOADER_FORMAT", "is_resumable", "resumable_class"]

LOADER_FORMAT: Final = "detctx.loader"
"""The ``"format"`` entry of a resumable loader's ``state_dict()``."""

_LOADER_VERSION: Final = 2  # 2: the configuration, the draws, the epoch and a digest
_DIGESTED: Final = ("config", "loader", "generator", "generator_before", "epoch")
_LOADER_KEYS: Final = frozenset({"format", "version", "digest", *_DIGESTED})
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


def is_resumable(loader: Any) -> bool:
    """``loader`` was built by ``resumable_loader``."""
    return _loader_class is not None and isinstance(loader, _loader_class)


def resumable_class() -> type[Any]:
    """The ``ResumableLoader`` class (imports ``torchdata`` the first time)."""
    global _loader_class
    if _loader_class is None:
        _loader_class = _build_class(_stateful_dataloader())
    return _loader_class


def _build_class(base: Any) -> type[Any]:
    class ResumableLoader(base):  # type: ignore[misc]
        """A ``torchdata`` ``StatefulDataLoader`` that resumes bit for bit, or refuses a
        state it cannot resume exactly: see ``detctx.resumable_loader``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # The rank that built the loader: its generator and shard are that rank's
            # (read first: a bad $RANK or $WORLD_SIZE fails before a loader exists).
            self._placement = (current_rank(), current_world_size())
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

        def configuration(self) -> dict[str, Any]:
            """What decides the batches and where, as saved in ``state_dict()['config']``."""
            return describe_loader(self, *self._placement)

        def state_dict(self) -> dict[str, Any]:
            position = super().state_dict()
            generator = self._generator_at_start
            if generator is None and self.generator is not None:
                generator = self.generator.get_state()
            state = {
                "format": LOADER_FORMAT,
                "version": _LOADER_VERSION,
                "config": self.configuration(),
                "loader": position,
                "generator": generator,
                "generator_before": self._generator_before,
                "epoch": self._epoch_at_start,
            }
            state["digest"] = digest({key: state[key] for key in _DIGESTED})
            return state

        def check_state(self, state: Any, where: str = "the loader state") -> None:
            """Raise :class:`~detctx.CheckpointError` unless this loader resumes ``state``
            exactly."""
            state = open_envelope(
                state,
                LOADER_FORMAT,
                _LOADER_VERSION,
                what=where,
                refusal=f"{where} was not saved by a detctx resumable loader",
            )
            if state["version"] < _LOADER_VERSION:
                # Version 1 held neither the configuration nor the draws it is checked by.
                raise CheckpointError(
                    f"{where} has version {state['version']}, saved before loader states held "
                    "what a resume is checked against: resume from a checkpoint saved by this "
                    "detctx, or with the detctx that saved it"
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
            # Last, so that a state that fails a check above is told what differs; this
            # catches what no check can: one valid RNG state put in place of another.
            if not same_plain(state["digest"], digest({key: state[key] for key in _DIGESTED})):
                raise CheckpointError(
                    f"{where} was changed after it was saved (its digest does not match what "
                    "it holds): a corrupted or edited checkpoint; resume from another one"
                )

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
