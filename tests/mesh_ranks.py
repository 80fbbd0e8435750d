"""Seeding over a (pp=2, dp=2) DeviceMesh, for tests/test_mesh_seeds.py (torchrun, 4 ranks).

``torchrun --standalone --nproc-per-node 4 tests/mesh_ranks.py OUT`` builds the mesh on a gloo
group and writes ``OUT/rank<r>.json``: what each rank drew inside
``distributed_deterministic(seed=1000, mesh=mesh, distinct_dims=...)`` for ``("pp",)`` and
``("dp", "pp")``, whether its state came back after the block, and the errors it got for a
mesh it is not in, ``per_rank`` with ``mesh``, and ranks that disagree on ``distinct_dims``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor import _random as dtensor_random

import detctx

SEED = 1000


def inside(mesh: DeviceMesh, dims: tuple[str, ...]) -> dict[str, Any]:
    before = detctx.capture()
    with detctx.distributed_deterministic(
        seed=SEED, mesh=mesh, distinct_dims=dims, verify=True
    ) as seeding:
        seen = {
            "initial_seed": torch.initial_seed(),
            "seed": seeding.seed,
            "torch": torch.rand(3).tolist(),
            "numpy": np.random.random(2).tolist(),
            "random": random.random(),
        }
        # A random DTensor op on a CPU mesh: torch makes no RNG tracker for CPU, and each
        # rank fills its local tensor from its CPU generator, which the block seeded.
        replicated = distribute_tensor(torch.zeros(2, 2), mesh["dp"], [Replicate()])
        seen["dtensor"] = replicated.uniform_().to_local().flatten().tolist()
        seen["tracker"] = dtensor_random._rng_tracker is not None
        detctx.verify_across_ranks()  # compares only the ranks seeded alike
    seen["restored"] = detctx.capture() == before
    return seen


def sharded_after_distinct_init(mesh: DeviceMesh) -> dict[str, Any]:
    """A layer built where the dp ranks' streams differ, then sharded over dp."""
    with detctx.distributed_deterministic(seed=SEED, mesh=mesh, distinct_dims=("dp", "pp")):
        layer = torch.nn.Linear(2, 4)
    own = layer.weight.detach().clone()
    fully_shard(layer, mesh=mesh["dp"])
    full = layer.weight.full_tensor()
    dp_rank = mesh.get_local_rank("dp")
    mine = slice(2 * dp_rank, 2 * dp_rank + 2)
    return {
        "own rows kept": torch.equal(full[mine], own[mine]),
        "whole layer is this rank's": torch.equal(full, own),
    }


def error_of(action: Any) -> str:
    try:
        action()
    except Exception as exc:  # the test reads the class and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    first_two = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",))
    result: dict[str, Any] = {
        "rank": rank,
        "coordinate": list(mesh.get_coordinate() or ()),
        "pp": inside(mesh, ("pp",)),
        "dp, pp": inside(mesh, ("dp", "pp")),
        "no distinct dims": inside(mesh, ()),
        "fully_shard after a distinct init": sharded_after_distinct_init(mesh),
        "not in the mesh": error_of(
            lambda: detctx.distributed_deterministic(seed=SEED, mesh=first_two)
        ),
        "with per_rank": error_of(
            lambda: detctx.distributed_deterministic(
                seed=SEED, mesh=mesh, distinct_dims=("pp",), per_rank=True
            )
        ),
    }

    def disagree() -> None:
        dims = ("pp",) if rank % 2 == 0 else ("dp",)
        with detctx.distributed_deterministic(seed=SEED, mesh=mesh, distinct_dims=dims):
            pass

    result["ranks disagree on the dims"] = error_of(disagree)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
