"""Scenario 11: recording a step with statistics, and comparing two long traces.

``detctx.recording`` (per-op statistics, sketch, digest, data flow) on the
small nanoGPT-style step (``benchmarks/gpt_step.py``: C=256, 4 layers,
T=128, batch 16, two AdamW steps), timed against the plain step, interleaved
in one process, one torch thread: target at most 1.5x. Then two traces of
``--steps`` steps at the tiny size (about 50,000 ops each at 130 steps; the
issue's 40 steps of a larger model), the second from another seed so that
every op differs and is listed (the slowest report), compared with
``detctx.compare_traces``: target at most 10 s. Trace bytes per op are printed.

    python -m benchmarks.s11_across_environments --repeat 3 --steps 130
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.gpt_step import SIZES, train_step
from benchmarks.harness import interleaved

RECORD_TARGET = 1.5
COMPARE_TARGET = 10.0


def recording_cost(folder: Path, repeat: int) -> tuple[dict[str, float], int, int]:
    import detctx

    size = SIZES["small"]
    trace = folder / "small.trace"

    def plain() -> None:
        torch.manual_seed(7)
        train_step(size)

    def recorded() -> None:
        torch.manual_seed(7)
        with detctx.recording(trace):
            train_step(size)

    contenders = {"plain step": plain, "recorded step": recorded}
    times = {name: stats.low for name, stats in interleaved(contenders, repeat).items()}
    from detctx._compare.format import read_trace

    return times, len(read_trace(trace)), trace.stat().st_size


def compare_cost(folder: Path, steps: int) -> tuple[float, int, int, str]:
    import detctx

    size = SIZES["tiny"]
    paths = [folder / "a.trace", folder / "b.trace"]
    for path, seed in zip(paths, (7, 8)):
        torch.manual_seed(seed)
        with detctx.recording(path):
            train_step(size, steps=steps)
    start = time.perf_counter()
    result = detctx.compare_traces(*paths)
    seconds = time.perf_counter() - start
    from detctx._compare.format import read_trace

    ops = [len(read_trace(path)) for path in paths]
    origin = result.origin["op"] if result.origin else None
    verdict = f"{len(result.past_tolerance)} ops past tolerance, origin {origin}"
    return seconds, ops[0], ops[1], verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=130)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="detctx-s11-") as name:
        folder = Path(name)
        times, ops, size = recording_cost(folder, args.repeat)
        ratio = times["recorded step"] / times["plain step"]
        print(f"small step, 2 AdamW steps, 1 thread, best of {args.repeat}:")
        met = "MET" if ratio <= RECORD_TARGET else "MISSED"
        print(
            f"  plain {times['plain step']:.3f} s, recorded {times['recorded step']:.3f} s: "
            f"{ratio:.2f}x (target <= {RECORD_TARGET}x) {met}"
        )
        print(f"  trace: {ops} ops, {size} bytes, {size / ops:.0f} bytes per op")
        seconds, ops_a, ops_b, verdict = compare_cost(folder, args.steps)
        print(f"compare of two {args.steps}-step traces (tiny size, seeds 7 and 8):")
        print(
            f"  {ops_a} and {ops_b} ops: {seconds:.2f} s (target <= {COMPARE_TARGET} s) "
            f"{'MET' if seconds <= COMPARE_TARGET else 'MISSED'}; {verdict}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
