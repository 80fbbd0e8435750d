"""A dataset that wraps another: its length and attributes are the wrapped dataset's."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WrappedDataset"]


class WrappedDataset(torch.utils.data.Dataset[Any]):
    """``dataset`` behind a wrapper that changes how items are read, nothing else."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks (``__getitems__``, user attributes).
        # ``dataset`` itself is looked up in __dict__, which is empty while unpickling.
        inner = self.__dict__.get("dataset")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
