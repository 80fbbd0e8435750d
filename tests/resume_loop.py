"""A small training loop that checkpoints in the middle of an epoch, for the resume tests.

``python tests/resume_loop.py WORKERS STEPS OUT [--save-at N | --resume]
[--world 2]`` trains ``STEPS`` steps in total and writes each rank's losses
and final weights to ``OUT.rank<r>``. ``--save-at N`` also writes each
rank's checkpoint after step ``N`` to ``OUT.rank<r>.ckpt`` (model,
optimiser, step and ``detctx.resume_state(loader)``) and trains on;
``--resume`` starts from that checkpoint instead. The dataset draws from
torch, NumPy and Python in ``__getitem__``, the model has dropout, and the
loader shuffles. With ``--world 2`` two forked ranks train one DDP model in
a gloo group, each on its half of the data with its own streams
(``per_rank=True``), and each saves and resumes its own state.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import torch
from helpers import NoisyPoints, fork_ranks

import detctx


def batches(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch (a resumed loader first finishes its epoch)."""
    while True:
        yield from loader


def train(
    workers: int, steps: int, save_at: int | None, checkpoint_path: str, resume: bool, world: int
) -> dict[str, Any]:
    rank = torch.distributed.get_rank() if world > 1 else 0
    with detctx.distributed_deterministic(seed=1234, per_rank=True):
        with detctx.deterministic(seed=0):  # the same initial weights on every rank
            model: torch.nn.Module = torch.nn.Sequential(
                torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
            )
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        shard = torch.utils.data.Subset(NoisyPoints(), range(rank, 20, world))
        loader = detctx.resumable_loader(
            shard, batch_size=6 // world, shuffle=True, num_workers=workers
        )
        start = 0
        if resume:
            checkpoint = torch.load(checkpoint_path, weights_only=True)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            start = checkpoint["step"]
            detctx.resume(checkpoint["detctx"], loader)
        losses = []
        for step, (x, y) in zip(range(start, steps), batches(loader)):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if step + 1 == save_at:
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step + 1,
                    "detctx": detctx.resume_state(loader),
                }
                torch.save(checkpoint, checkpoint_path)
        return {"losses": losses, "weights": [p.detach().clone() for p in model.parameters()]}


def run_rank(rank: int, options: argparse.Namespace, port: int) -> None:
    out = f"{options.out}.rank{rank}"
    if options.world > 1:
        store = torch.distributed.TCPStore("127.0.0.1", port, options.world, is_master=False)
        torch.distributed.init_process_group(
            "gloo", store=store, rank=rank, world_size=options.world
        )
    try:
        result = train(
            options.workers,
            options.steps,
            options.save_at,
            out + ".ckpt",
            options.resume,
            options.world,
        )
    finally:
        if options.world > 1:
            torch.distributed.destroy_process_group()
    torch.save(result, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workers", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("out")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--world", type=int, default=1)
    options = parser.parse_args()
    if options.world == 1:
        run_rank(0, options, 0)
        return
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    fork_ranks(run_rank, options.world, options, store.port)


if __name__ == "__main__":
    main()
