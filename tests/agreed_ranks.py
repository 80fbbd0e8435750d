"""Refusals every rank agrees on, for tests/test_agreed_refusals.py (torchrun, 2 or 4 ranks).

``torchrun --standalone --nproc-per-node W tests/agreed_ranks.py OUT`` runs on a gloo group and
writes ``OUT/rank<r>.json``. On 2 ranks: a DCP load where rank 1 built its loader with batch
size 8 (4 saved), a DCP entry with its two ranks swapped (its digest computed again), the
natural DCP pattern (``dcp.save`` of ``detctx.resume_state``), rank 0's ``resume_state`` (no
loader, an elastic loader, a resumable loader) resumed on both ranks, with and without
``any_rank=True``, meshes with other dim names, and a distinct dim the mesh leaves out; rank 0
also writes its three states to ``OUT/rank0-of-2.pt``. On 4 ranks: those states resumed (every
rank from rank 0 of 2's). Each refusal is recorded as its class and message, and whether every
RNG and loader was as before.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import detctx
from detctx._data import dcp_state

SEED = 1000


def resumable(batch_size: int = 4) -> Any:
    return detctx.resumable_loader(list(range(32)), batch_size=batch_size, shuffle=True, seed=5)


def elastic() -> Any:
    return detctx.elastic_loader(list(range(32)), batch_size=2, seed=5, drop_last=True)


def outcome(call: Any, *loaders: Any) -> dict[str, Any]:
    """Run ``call``; its error, and whether the RNGs and the loaders are as before."""
    before = detctx.capture()
    positions = [_position(loader) for loader in loaders]
    try:
        call()
    except Exception as exc:
        unchanged = detctx.capture() == before and [_position(x) for x in loaders] == positions
        return {"error": type(exc).__name__, "message": str(exc), "unchanged": unchanged}
    return {"error": None, "message": "", "unchanged": detctx.capture() == before}


def _position(loader: Any) -> Any:
    if isinstance(loader, detctx.ElasticLoader):
        return (loader.epoch, loader.consumed)
    return loader.next_iter_state is not None


def bad_loader_in_a_dcp_load(folder: str, rank: int) -> dict[str, Any]:
    saving = resumable()
    next(iter(saving))
    dcp.save({"detctx": detctx.dcp_resume_state(saving)}, checkpoint_id=f"{folder}/bad")
    torch.rand(3)
    loader = resumable(batch_size=8 if rank == 1 else 4)
    state = {"detctx": detctx.dcp_resume_state(loader)}
    return outcome(lambda: dcp.load(state, checkpoint_id=f"{folder}/bad"), loader)


def swapped_dcp_entries() -> dict[str, Any]:
    loader = elastic()
    next(iter(loader))
    saved = detctx.dcp_resume_state(loader).state_dict()
    blob = saved["ranks"]
    head = len(dcp_state._MAGIC) + dcp_state._DIGEST_SIZE
    payload = torch.load(__import__("io").BytesIO(blob[head:]), weights_only=True)
    payload["ranks"] = payload["ranks"][::-1]
    body = dcp_state._to_bytes(payload)
    swapped = {"ranks": dcp_state._MAGIC + dcp_state._digest(body) + body}
    return outcome(lambda: detctx.dcp_resume_state(loader).load_state_dict(swapped), loader)


def natural_dcp_pattern(folder: str) -> dict[str, Any]:
    loader = elastic()
    next(iter(loader))
    state = {"detctx": detctx.resume_state(loader)}
    dcp.save(state, checkpoint_id=f"{folder}/natural")
    torch.rand(3)
    dcp.load(state, checkpoint_id=f"{folder}/natural")
    return outcome(lambda: detctx.resume(state["detctx"], loader), loader)


def rank0_states() -> dict[str, Any]:
    """Rank 0's resume states with no loader, an elastic loader, a resumable loader."""
    made = {}
    for kind, build in (("no loader", None), ("elastic", elastic), ("resumable", resumable)):
        loaders = () if build is None else (build(),)
        made[kind] = detctx.resume_state(*loaders)
    shared = [made if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared)
    return shared[0]  # type: ignore[no-any-return]


def resumed_everywhere(states: dict[str, Any], **options: Any) -> dict[str, Any]:
    seen = {}
    for kind, build in (("no loader", None), ("elastic", elastic), ("resumable", resumable)):
        loaders = () if build is None else (build(),)
        seen[kind] = outcome(
            lambda: detctx.resume(states[kind], *loaders, **options),  # noqa: B023
            *loaders,
        )
    return seen


def meshes_with_other_names(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",) if rank == 0 else ("fsdp",))

    def enter() -> None:
        with detctx.distributed_deterministic(seed=SEED, mesh=mesh):
            pass

    return outcome(enter)


def absent_dims() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    seeds = {}
    for dims in (("pp",), ("pp", "dp_shard")):
        with detctx.distributed_deterministic(seed=SEED, mesh=mesh, distinct_dims=dims) as run:
            seeds["+".join(dims)] = [run.seed, torch.initial_seed()]
    return seeds


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = [str(out / "dcp")]
    result: dict[str, Any] = {"rank": rank}
    if world == 2:
        result["bad loader in a DCP load"] = bad_loader_in_a_dcp_load(folder[0], rank)
        result["swapped DCP entries"] = swapped_dcp_entries()
        result["natural DCP pattern"] = natural_dcp_pattern(folder[0])
        states = rank0_states()
        if rank == 0:
            torch.save(states, out / "rank0-of-2.pt")
        result["rank 0's state"] = resumed_everywhere(states)
        result["rank 0's state, any_rank=True"] = resumed_everywhere(states, any_rank=True)
        if importlib.util.find_spec("torch.distributed.device_mesh") is not None:
            result["meshes with other names"] = meshes_with_other_names(rank)
            result["absent dims"] = absent_dims()
    else:
        states = torch.load(out.parent / "two" / "rank0-of-2.pt", weights_only=True)
        result["rank 0 of 2's state"] = resumed_everywhere(states)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
