"""Scenario 11: recording a step with statistics, and comparing two long traces.

``detctx.recording`` (per-op statistics, sketch, digest, data flow) on the
small nanoGPT-style step (``benchmarks/gpt_step.py``: C=256, 4 layers,
T=128, batch 16, two AdamW steps), timed against the plain step in one
process, one torch thread: target at most 1.5x. Each round runs both (in
alternating order); the ratio is the median of the rounds' ratios, so a
machine whose speed drifts between rounds (a shared one) is compared
with itself. On the 2-core test machine single rounds range from 1.2x to
1.7x, so the default is 20 rounds (three runs on one day: 1.37x, 1.39x,
1.47x; runs of 8 to 10 rounds the same day: 1.43x to 1.57x). With one
torch thread a core is spare, so the recording's helper thread
summarises large outputs beside the step (:mod:`detctx._compare.summaries`):
the process's CPU time and the program's own thread's are printed beside
the wall time (the latter is what the recording takes from the program,
less noisy than the wall time), and a third contender times the recording
with the helper off, everything in line. Then two traces of ``--steps``
steps at the tiny size (about 50,000 ops each at 130 steps; the issue's
40 steps of a larger model), the second from another seed so that every
op differs and is listed (the slowest report), compared with
``detctx.compare_traces``: target at most 10 s. Trace bytes per op are
printed.

    python -m benchmarks.s11_across_environments --repeat 20 --steps 130
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.gpt_step import SIZES, train_step

RECORD_TARGET = 1.5
COMPARE_TARGET = 10.0


def recording_cost(
    folder: Path, repeat: int
) -> tuple[dict[str, list[tuple[float, float, float]]], int, int]:
    import detctx
    import detctx._compare.recorder as recorder

    size = SIZES["small"]
    trace = folder / "small.trace"
    spare_core = recorder.spare_core

    def plain() -> None:
        torch.manual_seed(7)
        train_step(size)

    def recorded() -> None:
        torch.manual_seed(7)
        with detctx.recording(trace):
            train_step(size)

    def in_line() -> None:
        recorder.spare_core = lambda: False
        try:
            recorded()
        finally:
            recorder.spare_core = spare_core

    contenders = {"plain step": plain, "recorded step": recorded, "helper off": in_line}
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in contenders}
    for run in contenders.values():
        run()  # warm up
    names = list(contenders)
    for round_ in range(repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu, mine = time.perf_counter(), time.process_time(), time.thread_time()
            contenders[name]()
            times[name].append(
                (
                    time.perf_counter() - wall,
                    time.process_time() - cpu,
                    time.thread_time() - mine,
                )
            )
    from detctx._compare.reading import read_trace

    return times, len(read_trace(trace)), trace.stat().st_size


def _ratios(
    times: dict[str, list[tuple[float, float, float]]], name: str, column: int
) -> tuple[float, float, float, float, float]:
    """Median of the rounds' ratios to the plain step, the two medians' seconds, and the
    lowest and highest round's ratio."""
    plain = [sample[column] for sample in times["plain step"]]
    other = [sample[column] for sample in times[name]]
    ratios = [o / p for o, p in zip(other, plain)]
    return (
        statistics.median(ratios),
        statistics.median(plain),
        statistics.median(other),
        min(ratios),
        max(ratios),
    )


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
    from detctx._compare.reading import read_trace

    ops = [len(read_trace(path)) for path in paths]
    origin = result.origin.op if result.origin else None
    verdict = f"{len(result.past_tolerance)} ops past tolerance, origin {origin}"
    return seconds, ops[0], ops[1], verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--steps", type=int, default=130)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="detctx-s11-") as name:
        folder = Path(name)
        times, ops, size = recording_cost(folder, args.repeat)
        ratio, plain, recorded, low, high = _ratios(times, "recorded step", 0)
        print(f"small step, 2 AdamW steps, 1 torch thread, {args.repeat} rounds (medians):")
        met = "MET" if ratio <= RECORD_TARGET else "MISSED"
        print(
            f"  plain {plain:.3f} s, recorded {recorded:.3f} s: {ratio:.2f}x "
            f"(target <= {RECORD_TARGET}x) {met}; rounds {low:.2f}x to {high:.2f}x"
        )
        cpu, plain_cpu, recorded_cpu, _, _ = _ratios(times, "recorded step", 1)
        print(f"  CPU time: plain {plain_cpu:.3f} s, recorded {recorded_cpu:.3f} s: {cpu:.2f}x")
        own, plain_own, recorded_own, _, _ = _ratios(times, "recorded step", 2)
        print(
            f"  the program's thread alone: plain {plain_own:.3f} s, recorded "
            f"{recorded_own:.3f} s of CPU: {own:.2f}x"
        )
        alone, _, in_line, low, high = _ratios(times, "helper off", 0)
        print(
            f"  helper off (every row in line): {in_line:.3f} s: {alone:.2f}x; "
            f"rounds {low:.2f}x to {high:.2f}x"
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
