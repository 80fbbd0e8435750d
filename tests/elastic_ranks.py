"""A data-parallel loop over an elastic loader, for the elastic resume tests (run by torchrun).

``torchrun --standalone --nproc-per-node W tests/elastic_ranks.py OUT STEPS [--save-at N |
--resume CHECKPOINT]`` trains ``STEPS`` steps of a global batch of 6 samples (``6 // W`` per
rank) on a gloo group, over epochs of 20 samples (3 steps each, 2 samples dropped), and rank
0 writes ``OUT`` (JSON): for each step, the global batch as loaded (each sample's index and a
digest of its bytes, augmentation included, ranks in rank order) and the global loss (the
mean of the ranks' losses, as the averaged gradient sees it). ``--save-at N`` also writes
``OUT.ckpt`` after step ``N`` (model, optimiser, step, the loader's position); ``--resume``
starts from such a checkpoint, saved with any world size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Any

import torch
from helpers import IndexedPoints

import detctx

GLOBAL_BATCH = 6


def digest(x: torch.Tensor) -> str:
    return hashlib.blake2b(x.numpy().tobytes(), digest_size=8).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume")
    options = parser.parse_args()
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with detctx.deterministic(seed=0):  # the same initial weights whatever the world size
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loader = detctx.elastic_loader(
        IndexedPoints(), batch_size=GLOBAL_BATCH // world, seed=1234, drop_last=True, num_workers=1
    )
    start = 0
    if options.resume:
        checkpoint = torch.load(options.resume, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])
        start = checkpoint["step"]
    steps: list[dict[str, Any]] = []

    def batches() -> Any:
        while True:
            yield from loader

    stream = batches()
    for step in range(start, options.steps):
        epoch = loader.epoch  # the epoch of the next batch
        index, x, y = next(stream)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        mine = [(int(i), digest(sample)) for i, sample in zip(index, x)]
        parts: list[Any] = [None] * world
        torch.distributed.all_gather_object(parts, (mine, loss.item()))
        samples = [sample for part, _ in parts for sample in part]
        global_loss = sum(part_loss for _, part_loss in parts) / world
        steps.append({"step": step, "epoch": epoch, "samples": samples, "loss": global_loss})
        if step + 1 == options.save_at and rank == 0:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step + 1,
                    "loader": loader.state_dict(),
                },
                options.out + ".ckpt",
            )
    if rank == 0:
        weights = [p.detach().flatten().tolist() for p in model.parameters()]
        with open(options.out, "w") as out:
            json.dump({"steps": steps, "weights": weights, "world": world}, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
