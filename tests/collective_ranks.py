"""Programs whose ranks talk through collectives, for tests/test_trace_distributed.py (torchrun,
2 ranks on gloo). Each prints one line per rank, ``rank R losses [...]``, with every loss's
``repr`` (what an unrecorded run prints is compared with a recorded run's, exactly).

    torchrun --standalone --nproc-per-node 2 tests/collective_ranks.py fsdp
    torchrun --standalone --nproc-per-node 2 tests/collective_ranks.py tensor-parallel
    torchrun --standalone --nproc-per-node 2 tests/collective_ranks.py ddp
    torchrun --standalone --nproc-per-node 2 tests/collective_ranks.py all-reduce [--nudge-rank 1]
        [--reduce-op max]

- ``fsdp``: an MLP with dropout, ``fully_shard`` per layer and at the root, AdamW, 3 steps.
- ``tensor-parallel``: an MLP whose layers are split over the ranks with DTensor
  (``parallelize_module``: the first column-wise, the second row-wise), AdamW, 3 steps.
- ``ddp``: an MLP wrapped in ``DistributedDataParallel``, AdamW, 3 steps.
- ``all-reduce``: each rank computes a tensor from its own data, ``all_reduce``\\ s it (in place,
  then asynchronously, then with ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, and
  once through the functional form) and reduces what it got to a number. ``--nudge-rank R``:
  rank R adds a scaled contribution to the first ``all_reduce``'s input; ``--reduce-op max``:
  the first ``all_reduce`` takes the maximum instead of the sum, so its inputs are those of a
  run with the sum and only its result differs.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
from torch.distributed.device_mesh import init_device_mesh


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)  # the same model on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def train(model: torch.nn.Module, rank: int, *, same_batch: bool = False) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(100 + (0 if same_batch else rank))
    torch.manual_seed(7 + rank)  # each rank's own dropout masks
    losses = []
    for _ in range(3):
        x = torch.randn(6, 8, generator=generator)
        y = torch.randn(6, 4, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def fsdp(world: int, rank: int) -> list[float]:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = mlp()
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return train(model, rank)


def tensor_parallel(world: int, rank: int) -> list[float]:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = mlp()
    plan = {"0": ColwiseParallel(), "3": RowwiseParallel()}
    parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
    # Tensor parallelism: every rank takes the same batch; dropout draws alike on every rank.
    return train(model, 0, same_batch=True)


def ddp(world: int, rank: int) -> list[float]:
    model = torch.nn.parallel.DistributedDataParallel(mlp())
    return train(model, rank)


def all_reduce(world: int, rank: int, nudge_rank: int | None, reduce_op: str) -> list[float]:
    generator = torch.Generator().manual_seed(100 + rank)
    weight = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 16, generator=generator)
    hidden = torch.tanh(x @ weight)
    scale = 1e-3 if rank == nudge_rank else 0.0
    hidden = hidden + scale * torch.sin(x)  # the nudge
    op = dist.ReduceOp.MAX if reduce_op == "max" else dist.ReduceOp.SUM
    dist.all_reduce(hidden, op=op)
    scaled = hidden * 0.5
    work = dist.all_reduce(scaled, async_op=True)
    assert work is not None
    work.wait()
    gathered = torch.empty(world * 4, 16)
    dist.all_gather_into_tensor(gathered, torch.relu(scaled))
    part = torch.empty(4 // world, 16)
    dist.reduce_scatter_tensor(part, torch.cos(scaled))
    summed = functional.all_reduce(torch.sigmoid(part), "sum", dist.group.WORLD)
    total = (gathered @ weight).square().mean() + summed.exp().mean()
    return [total.item(), scaled.sum().item()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("program", choices=("fsdp", "tensor-parallel", "ddp", "all-reduce"))
    parser.add_argument("--nudge-rank", type=int)
    parser.add_argument("--reduce-op", choices=("sum", "max"), default="sum")
    options = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    runs: dict[str, Any] = {
        "fsdp": fsdp,
        "tensor-parallel": tensor_parallel,
        "ddp": ddp,
    }
    if options.program == "all-reduce":
        losses = all_reduce(world, rank, options.nudge_rank, options.reduce_op)
    else:
        losses = runs[options.program](world, rank)
    print(f"rank {rank} losses {[repr(loss) for loss in losses]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
