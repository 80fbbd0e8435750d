"""Scenario 10: an elastic loader's epoch against a plain ``DataLoader``'s, loader-bound.

256 small images (3x8x8) with a random crop, flip and noise in
``__getitem__`` (torch draws only, as torchvision's transforms make), batches
of 32, read in this process (``num_workers=0``: the cost is all CPU time of
this process, none hidden in workers). The plain loader shuffles with its
own generator; the elastic loader seeds every sample's streams from its key:
every registered stream (the default), or only torch's (``streams=``).
A second dataset draws from torch, NumPy and Python, where every stream
must be seeded.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

import detctx
from benchmarks.harness import Result, Row, Settings, Target, measure
from benchmarks.harness import preserved_process_state as preserved

SCENARIO = "10 elastic loader"
SAMPLES = 256
BATCH = 32


class Images(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Small images, cropped, flipped and noised at random when read."""

    def __init__(self, every_stream: bool) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(SAMPLES, 3, 10, 10, generator=generator)
        self.every_stream = every_stream

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        top, left = torch.randint(0, 3, (2,)).tolist()
        image = self.images[index, :, top : top + 8, left : left + 8]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        image = image + 0.05 * torch.randn_like(image)
        if self.every_stream:
            image = image * float(np.random.uniform(0.9, 1.1)) + random.uniform(-0.1, 0.1)
        return image, index % 10


def epochs(loader: Any) -> Any:
    def run(n: int) -> None:
        for _ in range(n):
            for _ in loader:
                pass

    return run


def plain(dataset: Any) -> Any:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=generator)


def run(settings: Settings) -> Result:
    torch_only, every = Images(every_stream=False), Images(every_stream=True)
    with preserved():
        stats = measure(
            {
                "plain": epochs(plain(torch_only)),
                "elastic": epochs(detctx.elastic_loader(torch_only, batch_size=BATCH, seed=0)),
                "elastic torch": epochs(
                    detctx.elastic_loader(torch_only, batch_size=BATCH, seed=0, streams=["torch"])
                ),
                "plain, every stream": epochs(plain(every)),
                "elastic, every stream": epochs(
                    detctx.elastic_loader(every, batch_size=BATCH, seed=0)
                ),
            },
            settings,
        )
    per_epoch = f"{SAMPLES} samples, batches of {BATCH}, num_workers=0"
    return Result(
        [
            Row(
                SCENARIO,
                'epoch, elastic_loader(streams=["torch"]), torch augmentation',
                stats["elastic torch"],
                "the same epoch, DataLoader(shuffle=True)",
                stats["plain"],
                Target("ratio", 1.1),
                note=f"per epoch of {per_epoch}",
            ),
            Row(
                SCENARIO,
                "epoch, elastic_loader (every stream), torch augmentation",
                stats["elastic"],
                "the same epoch, DataLoader(shuffle=True)",
                stats["plain"],
                note="every registered stream seeded per sample: Python's random.seed is ~10 us",
            ),
            Row(
                SCENARIO,
                "epoch, elastic_loader (every stream), torch+NumPy+Python augmentation",
                stats["elastic, every stream"],
                "the same epoch, DataLoader(shuffle=True)",
                stats["plain, every stream"],
            ),
        ]
    )
