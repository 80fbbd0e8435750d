"""A small training loop that checkpoints in the middle of an epoch: the resume matrix's runs.

``python tests/resume_loop.py DIR straight|resumed CELL [CELL ...]`` runs each
cell (``SAMPLER-WORKERS``: ``shuffle-0``, ``random-2``, ``distributed-2p``, where
``2p`` is 2 persistent workers) for 11 steps of a 20-sample dataset and writes
each rank's losses, sample indices per step and final weights to
``DIR/PHASE.CELL.rank<r>``. ``straight`` also writes each rank's checkpoint
after step 5 (the second batch of the second epoch) to ``DIR/CELL.rank<r>.ckpt``
(model, optimiser, step and ``detctx.resume_state(loader)``) and trains on;
``resumed`` starts from that checkpoint, in this new process. The dataset
draws from torch, NumPy and Python in ``__getitem__``, the model has dropout
and Adam. The samplers:

- ``shuffle``: the recipe of docs/resume.md, ``shuffle=True`` over this rank's
  shard (``Subset(dataset, range(rank, 20, world))``);
- ``distributed``: a ``DistributedSampler`` over the whole dataset, with
  ``set_epoch`` at each epoch;
- ``random``: a ``RandomSampler`` over the shard with a generator of its own.

Under ``torchrun --nproc-per-node 2`` each cell trains one DDP model in a gloo
group, and in the ``resumed`` phase rank 1 first tries rank 0's checkpoint,
which must be refused with nothing changed (its message goes in the output).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

import torch
from helpers import IndexedPoints

import detctx

SAMPLES = 20
STEPS = 11
SAVE_AT = 5


def batches(loader: Any, epoch: int) -> Iterator[Any]:
    """The loader's batches from ``epoch`` on (a resumed loader first finishes its epoch)."""
    while True:
        if isinstance(loader.sampler, torch.utils.data.DistributedSampler):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def build_loader(cell: str, rank: int, world: int) -> Any:
    dataset = IndexedPoints()
    shard = torch.utils.data.Subset(dataset, range(rank, SAMPLES, world))
    sampler_kind, workers = cell.split("-")
    common = {
        "batch_size": 6 // world,
        "num_workers": int(workers.rstrip("p")),
        "persistent_workers": workers.endswith("p"),
    }
    if sampler_kind == "distributed":
        sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=17
        )
        return detctx.resumable_loader(dataset, sampler=sampler, **common)
    if sampler_kind == "random":
        generator = torch.Generator().manual_seed(100 + rank)
        sampler = torch.utils.data.RandomSampler(shard, generator=generator)
        return detctx.resumable_loader(shard, sampler=sampler, **common)
    return detctx.resumable_loader(shard, shuffle=True, **common)


def train(directory: str, cell: str, resume: bool, rank: int, world: int) -> dict[str, Any]:
    checkpoint_path = f"{directory}/{cell}.rank{rank}.ckpt"
    result: dict[str, Any] = {"losses": [], "indices": []}
    with detctx.distributed_deterministic(seed=1234, per_rank=True):
        with detctx.deterministic(seed=0):  # the same initial weights on every rank
            model: torch.nn.Module = torch.nn.Sequential(
                torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
            )
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        loader = build_loader(cell, rank, world)
        start = 0
        if resume:
            if world > 1:
                # A collective: every rank resumes rank 0's file; rank 1 refuses, so all do.
                result["other_rank"] = refusal_of(f"{directory}/{cell}.rank0.ckpt", loader)
            checkpoint = torch.load(checkpoint_path, weights_only=True)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            start = checkpoint["step"]
            detctx.resume(checkpoint["detctx"], loader)
        stream = batches(loader, start // len(loader))
        for step, (indices, x, y) in zip(range(start, STEPS), stream):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            result["losses"].append(loss.item())
            result["indices"].append(indices.tolist())
            if step + 1 == SAVE_AT and not resume:
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step + 1,
                    "detctx": detctx.resume_state(loader),
                }
                torch.save(checkpoint, checkpoint_path)
        result["weights"] = [p.detach().clone() for p in model.parameters()]
        result["batches_per_epoch"] = len(loader)
    return result


def refusal_of(path: str, loader: Any) -> str:
    """Resume ``loader`` from another rank's checkpoint: the refusal's message, nothing changed."""
    before = detctx.fingerprint()
    try:
        detctx.resume(torch.load(path, weights_only=True)["detctx"], loader)
    except detctx.CheckpointError as exc:
        unchanged = detctx.fingerprint() == before and loader.next_iter_state is None
        return str(exc) if unchanged else f"CHANGED: {exc}"
    return "ACCEPTED"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("phase", choices=["straight", "resumed"])
    parser.add_argument("cells", nargs="+")
    options = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # under torchrun
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if world > 1 else 0
    try:
        for cell in options.cells:
            result = train(options.directory, cell, options.phase == "resumed", rank, world)
            torch.save(result, f"{options.directory}/{options.phase}.{cell}.rank{rank}")
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
