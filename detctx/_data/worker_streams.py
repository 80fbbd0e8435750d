"""The RNG streams of DataLoader workers, carried in the loader's checkpoint.

``torchdata``'s ``StatefulDataLoader`` saves each worker's *dataset* state:
after a batch, the worker calls the dataset's ``state_dict()`` and sends the
result to the main process with the batch; on resume each new worker runs
its ``worker_init_fn`` and then the dataset's ``load_state_dict()``, before it
fetches anything. Nothing else of the worker is saved, so a worker that draws
random numbers (augmentation in ``__getitem__``, a random ``collate_fn``)
starts its streams over on resume.

:class:`WorkerStreams` wraps a map-style dataset so that its state also holds
the worker's RNG states (every registered source: ``random``, NumPy's global
generator, torch's CPU generator, user sources; no accelerator, as workers
must not touch devices). The state a worker sends with a batch is taken after
the batch was collated, so a resumed worker continues each stream from the
last batch the main process received from it. In the main process (no
workers) the wrapper adds nothing: those draws are the process's own streams,
which :func:`detctx.capture` saves.
"""

from __future__ import annotations

from typing import Any

import torch

from detctx._basics import CheckpointError
from detctx._data.wrapped import WrappedDataset
from detctx._sources import registered_sources
from detctx._state import Snapshot

__all__ = ["WorkerStreams"]


class WorkerStreams(WrappedDataset):
    """``dataset`` with each DataLoader worker's RNG states in its ``state_dict()``.

    Items, length and attributes are the wrapped dataset's (``.dataset``);
    the wrapped dataset's own ``state_dict()``, if it has one, is kept under
    ``"dataset"``.
    """

    def __init__(self, dataset: Any) -> None:
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError(
                "resumable_loader takes a map-style dataset (with __getitem__ and __len__); "
                f"{type(dataset).__name__} is an IterableDataset, whose position only the "
                "dataset itself can save: give it state_dict/load_state_dict and use "
                "torchdata's StatefulDataLoader directly"
            )
        if not callable(getattr(dataset, "__getitem__", None)):
            raise TypeError(
                f"resumable_loader takes a map-style dataset, got {type(dataset).__name__} "
                "(no __getitem__)"
            )
        super().__init__(dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]


    def state_dict(self) -> dict[str, Any]:
        """The wrapped dataset's state and, in a worker, the worker's RNG states."""
        saver = getattr(self.dataset, "state_dict", None)
        inner = saver() if callable(saver) else None
        streams = None
        if torch.utils.data.get_worker_info() is not None:
            streams = Snapshot.capture(list(registered_sources())).state_dict()
        return {"dataset": inner, "rng": streams}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put the wrapped dataset's state back and, in a worker, the worker's RNG states."""
        if not isinstance(state, dict) or set(state) != {"dataset", "rng"}:
            raise CheckpointError(
                "a worker's dataset state is not the one resumable_loader saves (keys "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}); "
                "was the checkpoint written by another loader?"
            )
        if state["dataset"] is not None:
            self.dataset.load_state_dict(state["dataset"])
        if state["rng"] is not None and torch.utils.data.get_worker_info() is not None:
            sources = list(registered_sources())
            Snapshot.from_state_dict(state["rng"], sources=sources).restore()
