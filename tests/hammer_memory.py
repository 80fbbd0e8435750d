"""Many blocks and generator steps, measuring memory before and after; prints one JSON line.

``python tests/hammer_memory.py BLOCKS``: after a warm-up, runs BLOCKS nested
block pairs and BLOCKS decorated generator steps twice, and reports the growth of
Python's traced allocations (tracemalloc) in each pass, the second being the
one a leak shows in, and of the resident set size over both.
"""

from __future__ import annotations

import gc
import json
import random
import sys
import tracemalloc

import numpy as np
from helpers import augment

import detctx


def rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4


def work(count: int) -> None:
    for _ in range(count):
        with detctx.deterministic(seed=1):
            np.random.rand()
            with detctx.deterministic(seed=2):
                random.random()
    steps = augment()
    for _ in range(count):
        next(steps)
    steps.close()


def traced_growth(count: int) -> int:
    before = tracemalloc.get_traced_memory()[0]
    work(count)
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - before


def main(count: int) -> None:
    work(min(count, 1000))  # warm-up: caches, lazy imports, allocator pools
    gc.collect()
    tracemalloc.start()
    rss_before = rss_kib()
    # Two equal passes: what a machine allocates once (a device backend's caches filling
    # up while traced) shows in the first; a leak grows by the same amount in both.
    first = traced_growth(count)
    second = traced_growth(count)
    rss_after = rss_kib()
    print(
        json.dumps(
            {
                "blocks": 2 * count,
                "generator_steps": count,
                "first_pass_growth_bytes": first,
                "traced_growth_bytes": second,
                "rss_growth_kib": rss_after - rss_before,
                "open_blocks": len(detctx.open_blocks()),
            }
        )
    )


if __name__ == "__main__":
    main(int(sys.argv[1]))
