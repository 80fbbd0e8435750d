"""Scenario 5: the distributed agreement step and ``verify_across_ranks`` on gloo.

2 and 4 ranks, spawned on loopback with a free port. On every rank, one
repeat times, in turn: the agreement step alone (``agree_seed(None)``: rank
0 draws the seed, every rank takes it; ``agree_seed(1234)``: every rank
checks every rank's seed), the raw collective it makes (an ``all_gather`` of
the same three int64 per rank), a raw ``broadcast`` of one int64 (the least
a seed=None agreement could send), ``distributed_deterministic(seed=None)``
enter+exit against a local ``deterministic`` block, and
``verify_across_ranks()`` against a raw ``all_gather`` of its row size.
Rank 0's figures are reported.

Every rank ends with ``dist.destroy_process_group()``; the parent kills ranks
that outlive the timeout.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import time
from datetime import timedelta
from typing import Any

from benchmarks.harness import Result, Row, Settings, Stats, Target

SCENARIO = "5 distributed (gloo)"
WORLD_SIZES = (2, 4)
AGREEMENT_WORDS = 3  # [seed, kind, per_rank]
VERIFY_WORDS = 38  # a verification row: 6 header words and 32 fingerprint slots


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def missing_api() -> str | None:
    import detctx

    absent = [
        name
        for name in ("distributed_deterministic", "verify_across_ranks")
        if not hasattr(detctx, name)
    ]
    if absent:
        return (
            f"not available: detctx.{' and detctx.'.join(absent)} not in this build "
            "(the distributed issue 4)"
        )
    return None


def _time_loop(fn: Any, n: int, dist: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def _rank_main(rank: int, world: int, port: int, quick: bool, out: Any) -> None:
    import torch
    import torch.distributed as dist

    import detctx

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        available = missing_api() is None
        # Forked ranks start with different Python RNG states; verify_across_ranks would
        # (rightly) report them. Every block restores, so this equal start stays equal.
        detctx.seed_all(1234)
        seed = torch.zeros(1, dtype=torch.int64)
        local = detctx.deterministic(seed=1234)

        def all_gather_of(words: int) -> Any:
            mine = torch.zeros(words, dtype=torch.int64)
            gathered = [torch.zeros(words, dtype=torch.int64) for _ in range(world)]
            return lambda: dist.all_gather(gathered, mine)

        def broadcast() -> None:
            dist.broadcast(seed, src=0)

        def local_block() -> None:
            with local:
                pass

        loops: dict[str, Any] = {
            "broadcast": broadcast,
            "local block": local_block,
            "all_gather agreement": all_gather_of(AGREEMENT_WORDS),
            "all_gather verify": all_gather_of(VERIFY_WORDS),
        }
        if available:
            agreeing = getattr(detctx, "distributed_deterministic")  # noqa: B009

            # A fresh object per block, as users write it: it may be single-use.
            def distributed_block() -> None:
                with agreeing(seed=None):
                    pass

            agree = getattr(detctx, "agree_seed")  # noqa: B009
            loops["agree None"] = lambda: agree(None)
            loops["agree 1234"] = lambda: agree(1234)
            loops["distributed block"] = distributed_block
            loops["verify"] = getattr(detctx, "verify_across_ranks")  # noqa: B009
        n, repeats = (20, 5) if quick else (200, 15)
        for fn in loops.values():
            _time_loop(fn, max(2, n // 10), dist)
        samples: dict[str, list[float]] = {name: [] for name in loops}
        for _ in range(repeats):
            for name, fn in loops.items():
                samples[name].append(_time_loop(fn, n, dist))
        if rank == 0:
            out.put({name: (values, n) for name, values in samples.items()})
    except BaseException as exc:
        if rank == 0:
            out.put({"error": repr(exc)})
        raise
    finally:
        dist.destroy_process_group()


def _launch(world: int, quick: bool, timeout_s: float) -> dict[str, Any]:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    if sys.platform.startswith("linux") and saved is None:
        # The host name may resolve to an interface the ranks cannot reach; loopback always works.
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        ranks = [
            context.Process(target=_rank_main, args=(rank, world, port, quick, out), daemon=True)
            for rank in range(world)
        ]
        for process in ranks:
            process.start()
    finally:
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    try:
        data: dict[str, Any] = out.get(timeout=timeout_s)
    except queue.Empty:
        data = {"error": f"no result within {timeout_s:.0f} s"}
    deadline = time.monotonic() + 30
    for process in ranks:
        process.join(timeout=max(0.1, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    return data


def run(settings: Settings) -> Result:
    missing = missing_api()
    rows: list[Row] = []
    for world in WORLD_SIZES:
        data = _launch(world, settings.quick, timeout_s=180 if settings.quick else 600)
        if "error" in data:
            rows.append(Row(SCENARIO, f"{world} ranks", None, note=f"failed: {data['error']}"))
            continue
        stats = {name: Stats.of(values, n) for name, (values, n) in data.items()}
        gather = f"one raw all_gather of {AGREEMENT_WORDS} int64 per rank"
        rows += [
            Row(
                SCENARIO,
                f"agreement step, seed=None, {world} ranks",
                stats.get("agree None"),
                gather,
                stats["all_gather agreement"],
                Target("ratio", 1.5),
                note=missing or "agree_seed(None): the one collective a block's entry makes",
            ),
            Row(
                SCENARIO,
                f"agreement step, seed=1234, {world} ranks",
                stats.get("agree 1234"),
                gather,
                stats["all_gather agreement"],
                Target("ratio", 1.5),
                note=missing or "agree_seed(1234): every rank checks every rank's seed",
            ),
            Row(
                SCENARIO,
                f"agreement step, seed=None, {world} ranks",
                stats.get("agree None"),
                "one raw broadcast of 1 int64",
                stats["broadcast"],
                note=missing
                or "a broadcast alone could not tell a rank that passed a seed from one that did",
            ),
            Row(
                SCENARIO,
                f"distributed_deterministic(seed=None) enter+exit, {world} ranks",
                stats.get("distributed block"),
                "deterministic() enter+exit",
                stats["local block"],
                note=missing or "",
            ),
            Row(
                SCENARIO,
                f"verify_across_ranks(), {world} ranks",
                stats.get("verify"),
                f"one raw all_gather of {VERIFY_WORDS} int64 per rank",
                stats["all_gather verify"],
                note=missing or "verify also captures and hashes every RNG state",
            ),
        ]
    return Result(rows)
