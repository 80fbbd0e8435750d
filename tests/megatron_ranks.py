"""Two gloo ranks with Megatron's tracker on simulated NPUs, for ``test_megatron.py``.

Started as ``python megatron_ranks.py PORT 2 OUT_DIR``: redirects ``torch.cuda`` to
the simulated NPU and imports Megatron once, forks two ranks that join a gloo
group through the test's TCP store, runs each scenario and writes what each
rank saw to ``OUT_DIR/rank<r>.json``:

- ``tp``: the ranks are two tensor-parallel ranks of one model replica;
- ``dp``: they are two data-parallel replicas of tensor-parallel rank 0;
- ``pp``: they are two pipeline stages, seeded with Megatron's offsets.
"""

from __future__ import annotations

import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import megatron_on_npu
from helpers import fork_ranks
from megatron_on_npu import draw

tracker_module = megatron_on_npu.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import detctx  # noqa: E402
from detctx.distributed import MegatronSeeds  # noqa: E402
from detctx.integrations.megatron import register_tracker  # noqa: E402


def divergence() -> dict[str, list[str]] | None:
    """What ``verify_across_ranks`` names, by rank, or None when the ranks agree."""
    try:
        detctx.verify_across_ranks(timeout=30)
    except detctx.RankDivergenceError as exc:
        return {str(rank): list(what) for rank, what in exc.divergent.items()}
    return None


def tensor_parallel(rank: int) -> dict[str, Any]:
    register_tracker(tp_rank=rank, ep_rank=0, etp_rank=rank)
    tracker_module.model_parallel_cuda_manual_seed(
        7, tp_rank=rank, ep_rank=0, etp_rank=rank, force_reset_rng=True
    )
    tracker = tracker_module.get_cuda_rng_tracker()
    seen: dict[str, Any] = {}
    with detctx.distributed_deterministic(seed=5):
        states = [None] * 2
        dist.all_gather_object(states, tracker.get_states()["model-parallel-rng"].tolist())
        seen["model_parallel_states_differ"] = states[0] != states[1]
        for _ in range(2):
            with tracker.fork():
                draw()
        seen["in_step"] = divergence()
        if rank == 1:
            with tracker.fork():
                draw()
        seen["extra_model_parallel_draw"] = divergence()
        if rank == 1:
            with tracker.fork("data-parallel-rng"):
                draw()
        seen["extra_data_parallel_draw"] = divergence()
    detctx.unregister_source("megatron")
    return seen


def data_parallel(rank: int) -> dict[str, Any]:
    register_tracker(tp_rank=0, ep_rank=0, etp_rank=0)
    tracker_module.model_parallel_cuda_manual_seed(
        7, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True
    )
    tracker = tracker_module.get_cuda_rng_tracker()
    seen: dict[str, Any] = {}
    with detctx.distributed_deterministic(seed=5):
        with tracker.fork():
            draw()
        seen["in_step"] = divergence()
        if rank == 1:
            with tracker.fork():
                draw()
        seen["extra_model_parallel_draw"] = divergence()
    detctx.unregister_source("megatron")
    return seen


def pipeline(rank: int) -> dict[str, Any]:
    register_tracker(tp_rank=0, ep_rank=0, etp_rank=0)
    stage = MegatronSeeds(pp_rank=rank)
    with detctx.distributed_deterministic(seed=5, megatron_seeds=stage) as run:
        torch.rand(rank + 1)  # each stage runs its own layers
        seen = {"seed": run.seed, "verified": divergence()}
    # Two data-parallel replicas of one stage are seeded alike, and compared.
    with detctx.distributed_deterministic(seed=5, megatron_seeds=MegatronSeeds(pp_rank=0)):
        torch.rand(rank + 1)
        seen["one_stage"] = divergence()
    detctx.unregister_source("megatron")
    return seen


def run_rank(rank: int, port: int, out_dir: str) -> None:
    warnings.simplefilter("ignore", detctx.DeterminismWarning)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        seen = {"tp": tensor_parallel(rank), "dp": data_parallel(rank), "pp": pipeline(rank)}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))


def main() -> None:
    port, world, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    fork_ranks(run_rank, world, port, out_dir)


if __name__ == "__main__":
    main()
