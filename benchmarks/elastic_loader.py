"""Scenario 10: an elastic loader's epoch against a plain ``DataLoader``'s, loader-bound.

256 small images (3x8x8) with a random crop, flip and noise in
``__getitem__`` (torch draws only, as torchvision's transforms make), batches
of 32, read in this process (``num_workers=0``: the cost is all CPU time of
this process, none hidden in workers). The plain loader shuffles with its
own generator; the elastic loader seeds every sample's streams from its key:
every registered stream (the default), or only torch's (``streams=``). The
floor seeds torch's generator before each sample and does nothing else. A
second dataset draws from torch, NumPy and Python, where every stream must
be seeded; a third is CIFAR-sized (3x32x32 bytes, padded crop, flip,
normalisation).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

import detctx
from benchmarks.harness import Result, Row, Settings, Table, Target, measure
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


class Cifar(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """CIFAR-sized images (3x32x32 bytes): padded random crop, flip, normalisation."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (SAMPLES, 3, 32, 32), generator=generator).byte()
        self.mean = torch.tensor([0.49, 0.48, 0.45]).view(3, 1, 1)
        self.std = torch.tensor([0.25, 0.24, 0.26]).view(3, 1, 1)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        top, left = torch.randint(0, 9, (2,)).tolist()
        padded = torch.nn.functional.pad(self.images[index], (4, 4, 4, 4))
        image = padded[:, top : top + 32, left : left + 32]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return (image.float() / 255 - self.mean) / self.std, index % 10


class SeededPerSample(torch.utils.data.Dataset[Any]):
    """The floor: torch's generator seeded before each sample, nothing else (no key, no
    put-back): what any per-sample keying of torch's stream pays."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        torch.default_generator.manual_seed(index)
        return self.dataset[index]


def epochs(loader: Any) -> Any:
    def run(n: int) -> None:
        for _ in range(n):
            for _ in loader:
                pass

    return run


def plain(dataset: Any) -> Any:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=generator)


def elastic(dataset: Any, streams: list[str] | None = None) -> Any:
    return epochs(detctx.elastic_loader(dataset, batch_size=BATCH, seed=0, streams=streams))


def thread_times(contenders: Mapping[str, Callable[[int], None]], rounds: int) -> dict[str, float]:
    """Median CPU time of this thread per epoch, the contenders taking turns in every round.

    The loader runs in this thread (num_workers=0), so its CPU time is the loader's cost;
    unlike wall time it hardly moves when other processes load the machine.
    """
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.thread_time()
            contenders[name](2)
            samples[name].append((time.thread_time() - start) / 2)
    return {name: statistics.median(values) for name, values in samples.items()}


def run(settings: Settings) -> Result:
    small, every, cifar = Images(every_stream=False), Images(every_stream=True), Cifar()
    with preserved():
        contenders = {
            "plain": epochs(plain(small)),
            "floor": epochs(plain(SeededPerSample(small))),
            "elastic torch": elastic(small, ["torch"]),
            "elastic": elastic(small),
            "plain, every stream": epochs(plain(every)),
            "elastic, every stream": elastic(every),
            "plain, cifar": epochs(plain(cifar)),
            "elastic torch, cifar": elastic(cifar, ["torch"]),
        }
        stats = measure(contenders, settings)
        cpu = thread_times(contenders, 6 if settings.quick else 30)
    plain_epoch = "the same epoch, DataLoader(shuffle=True)"
    pairs = [
        ('small images, elastic_loader(streams=["torch"])', "elastic torch", "plain"),
        ('small images, elastic_loader(streams=["torch"]) / floor', "elastic torch", "floor"),
        ("small images, floor (torch seeded per sample)", "floor", "plain"),
        ('CIFAR-sized, elastic_loader(streams=["torch"])', "elastic torch, cifar", "plain, cifar"),
        ("small images, elastic_loader (every stream)", "elastic", "plain"),
        ("small images, every stream drawn", "elastic, every stream", "plain, every stream"),
    ]
    table = Table(
        "Elastic loader: CPU time of the loading thread per epoch (median, interleaved)",
        ["contender", "ms per epoch", "against", "ms per epoch", "ratio"],
        [
            [label, f"{cpu[a] * 1e3:.2f}", b, f"{cpu[b] * 1e3:.2f}", f"{cpu[a] / cpu[b]:.2f}x"]
            for label, a, b in pairs
        ],
        note="time.thread_time: wall time on a loaded machine moves with the load, CPU time "
        "of the thread that loads (num_workers=0) hardly does",
    )
    return Result(
        [
            Row(
                SCENARIO,
                'epoch, elastic_loader(streams=["torch"]), small images, torch augmentation',
                stats["elastic torch"],
                plain_epoch,
                stats["plain"],
                Target("ratio", 1.1),
                note=f"per epoch of {SAMPLES} samples, batches of {BATCH}, num_workers=0",
            ),
            Row(
                SCENARIO,
                'epoch, elastic_loader(streams=["torch"]), small images, torch augmentation',
                stats["elastic torch"],
                "floor: the same DataLoader, torch's generator seeded before each sample",
                stats["floor"],
                note="the floor pays torch's seeding per sample (about 1.3 us of CPU)",
            ),
            Row(
                SCENARIO,
                'epoch, elastic_loader(streams=["torch"]), CIFAR-sized images',
                stats["elastic torch, cifar"],
                plain_epoch,
                stats["plain, cifar"],
                Target("ratio", 1.1),
            ),
            Row(
                SCENARIO,
                "epoch, elastic_loader (every stream), small images, torch augmentation",
                stats["elastic"],
                plain_epoch,
                stats["plain"],
                note="every registered stream seeded per sample: Python's random.seed is ~8 us",
            ),
            Row(
                SCENARIO,
                "epoch, elastic_loader (every stream), small images, torch+NumPy+Python draws",
                stats["elastic, every stream"],
                plain_epoch,
                stats["plain, every stream"],
            ),
        ],
        [table],
    )
