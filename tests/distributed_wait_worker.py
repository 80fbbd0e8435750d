"""Two ranks for ``test_distributed_wait.py``: nested blocks where rank 1 is missing.

Started as ``python distributed_wait_worker.py PORT 2 OUT_DIR``. Rank 1 stays
inside an outer ``verify=True`` block while rank 0 enters an inner one
("entry"), or stays inside the inner one while rank 0 leaves it ("exit"), each
on a group of its own. Rank 0 counts the gathers it starts and the timeouts it
waits out, and writes them to ``OUT_DIR/rank0.json``; the ranks move from one
scenario to the next through the store, not the broken groups.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from helpers import fork_ranks

from detctx import SeedAgreementError, distributed_deterministic
from detctx.distributed import _arrival

TIMEOUT_S = 1.0
STORE_WAIT = timedelta(seconds=60)


class Counts:
    """The gathers this rank started and the timeouts it waited out."""

    def __init__(self) -> None:
        self.gathers = 0
        self.timeouts = 0
        real_gather, real_missing = dist.all_gather, _arrival._missing_ranks

        def gather(*args: Any, **kwargs: Any) -> Any:
            self.gathers += 1
            return real_gather(*args, **kwargs)

        def missing(*args: Any, **kwargs: Any) -> Any:
            self.timeouts += 1
            return real_missing(*args, **kwargs)

        dist.all_gather = gather
        _arrival._missing_ranks = missing

    def since(self, gathers: int, timeouts: int) -> dict[str, int]:
        return {"gathers": self.gathers - gathers, "timeouts": self.timeouts - timeouts}


def attempt(counts: Counts, body: Any) -> dict[str, Any]:
    """Run ``body``; what it raised, how many gathers and timeouts it took, and how long."""
    start, gathers, timeouts = time.monotonic(), counts.gathers, counts.timeouts
    try:
        body()
        raised = None
    except SeedAgreementError as exc:
        raised = str(exc)
    return {
        "raised": raised,
        **counts.since(gathers, timeouts),
        "seconds": round(time.monotonic() - start, 2),
    }


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=STORE_WAIT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=STORE_WAIT)
    groups = {name: dist.new_group(backend="gloo") for name in ("entry", "exit")}
    counts = Counts()
    seen: dict[str, Any] = {}

    def block(name: str, seed: int) -> Any:
        return distributed_deterministic(
            seed=seed, group=groups[name], verify=True, timeout=TIMEOUT_S
        )

    def wait_for(key: str) -> None:
        store.wait([key], STORE_WAIT)

    def entry_on_rank0() -> None:
        with block("entry", 1):
            with block("entry", 2):
                pass

    def exit_on_rank0() -> None:
        with block("exit", 1):
            with block("exit", 2):
                pass

    if rank == 0:
        seen["entry"] = attempt(counts, entry_on_rank0)
        seen["again"] = attempt(counts, lambda: block("entry", 3).__enter__())
        store.set("entry/rank0-done", "1")
        seen["exit"] = attempt(counts, exit_on_rank0)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
        store.set("exit/rank0-done", "1")
    else:
        # Rank 1 never leaves: its exit check would meet rank 0's gather that timed out,
        # of another size, and gloo aborts a process on that (a collective mismatch).
        with block("entry", 1):
            wait_for("entry/rank0-done")
            with block("exit", 1):
                with block("exit", 2):
                    wait_for("exit/rank0-done")
                    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
                    os._exit(0)
    # No destroy_process_group: the timed-out gathers are never answered (see
    # distributed_worker.py); os._exit closes the connections.
    os._exit(0)


def main() -> None:
    port, world, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    fork_ranks(run_rank, world, world, port, out_dir)


if __name__ == "__main__":
    main()
