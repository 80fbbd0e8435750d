"""FSDP2 training with DCP checkpoints, for tests/test_fsdp_dcp.py (torchrun, 1 or 2 ranks).

``torchrun --standalone --nproc-per-node W tests/fsdp_ranks.py OUT STEPS [--save-at N CKPT]
[--async-save] [--resume CKPT]`` builds a small model with dropout (the same initial weights on
every rank), shards it with ``fully_shard`` on a one-dim ("dp") mesh, and trains ``STEPS``
steps over an elastic loader with one worker (a global batch of 4 samples, ``4 // W`` per
rank) inside ``distributed_deterministic(seed=1234, mesh=mesh, distinct_dims=("dp",))``, so
each rank draws its own dropout masks. ``--save-at N CKPT`` saves a DCP checkpoint after
step ``N`` (model, optimiser, step, ``detctx.dcp_resume_state(loader)``; ``--async-save``:
with ``dcp.async_save``); ``--resume CKPT`` starts from one, saved on any world size. Each
rank writes ``OUT/rank<r>.json``: per step its loss and the sample indices it took; rank 0
adds the full weights at the end.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import IndexedPoints
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import detctx

GLOBAL_BATCH = 4


def build(mesh: Any) -> torch.nn.Module:
    with detctx.deterministic(seed=0):  # the same initial weights on every rank
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def show_dedup(folder: str, rank: int, loader: Any) -> dict[str, Any]:
    """What DCP gives each rank back of values every rank saves under the same keys: plain
    ones, and ``detctx.resume_state``'s dict (each rank's RNGs differ here)."""
    saved = {"pos": 100 + rank, "t": torch.tensor([rank, rank])}
    dcp.save(saved, checkpoint_id=f"{folder}/plain")
    loaded = {"pos": -1, "t": torch.tensor([-1, -1])}
    dcp.load(loaded, checkpoint_id=f"{folder}/plain")
    own = detctx.capture()
    state = {"detctx": detctx.resume_state(loader)}
    dcp.save(state, checkpoint_id=f"{folder}/resume_state")
    torch.rand(5)  # move on, as training would
    dcp.load(state, checkpoint_id=f"{folder}/resume_state")
    try:
        detctx.resume(state["detctx"], loader)
        outcome = "own state back" if detctx.capture() == own else "another rank's state"
    except detctx.CheckpointError:
        outcome = "refused"
    return {"pos": loaded["pos"], "t": loaded["t"].tolist(), "resume_state": outcome}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--save-at", nargs=2)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--resume")
    parser.add_argument("--show-dedup")
    options = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = build(mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = detctx.elastic_loader(
        IndexedPoints(), batch_size=GLOBAL_BATCH // world, seed=7, drop_last=True, num_workers=1
    )
    steps: list[dict[str, Any]] = []
    result: dict[str, Any] = {"rank": rank, "world": world, "steps": steps}
    if options.show_dedup:
        with detctx.distributed_deterministic(seed=99, mesh=mesh, distinct_dims=("dp",)):
            result["dedup"] = show_dedup(options.show_dedup, rank, loader)
    with detctx.distributed_deterministic(seed=1234, mesh=mesh, distinct_dims=("dp",)):
        start = 0
        if options.resume:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {
                "model": model_state,
                "optim": optim_state,
                "step": 0,
                "detctx": detctx.dcp_resume_state(loader),
            }
            dcp.load(state, checkpoint_id=options.resume)  # resumes detctx's part here
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            start = state["step"]

        def batches() -> Any:
            while True:
                yield from loader

        stream = batches()
        for step in range(start, options.steps):
            index, x, y = next(stream)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            steps.append({"step": step, "loss": loss.item(), "samples": index.tolist()})
            if options.save_at and step + 1 == int(options.save_at[0]):
                model_state, optim_state = get_state_dict(model, optimizer)
                state = {
                    "model": model_state,
                    "optim": optim_state,
                    "step": step + 1,
                    "detctx": detctx.dcp_resume_state(loader),
                }
                if options.async_save:
                    dcp.async_save(state, checkpoint_id=options.save_at[1]).result()
                else:
                    dcp.save(state, checkpoint_id=options.save_at[1])
    weights = [p.full_tensor().flatten().tolist() for p in model.parameters()]
    if rank == 0:
        result["weights"] = weights
    Path(options.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
