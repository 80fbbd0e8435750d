"""Scenario 13: the memory a recording holds when its helper falls behind.

A program of ``--ops`` tiny ops (``x = x + 1`` on four float32 numbers, two
million by default) runs in a fresh process, once unrecorded and once under
``detctx.recording``, one torch thread each, with a CPU hog (a Python
process spinning) beside it, so the recording's helper thread, which
summarises and writes the rows, gets less of a core than the program: the
queue of ops waiting for it is what grows. Printed: each process's peak RSS
(``ru_maxrss``) and wall time, and the recorded one's peak above the
unrecorded one's (target: at most 500 MB; before the queue was bounded by
ops as well as by bytes, 2.3 to 2.7 GB).

    python -m benchmarks.s13_record_memory [--ops 2000000] [--no-hog]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
TARGET_MB = 500.0


def program(ops: int, trace: str | None) -> dict[str, float]:
    """Run the tiny ops (recorded into ``trace`` if given); peak RSS in MB and seconds."""
    import contextlib
    import resource

    import torch

    import detctx

    torch.set_num_threads(1)
    x = torch.zeros(4)
    block = detctx.recording(trace) if trace else contextlib.nullcontext()
    start = time.perf_counter()
    with block:
        for _ in range(ops):
            x = x + 1
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"peak_mb": peak, "seconds": seconds, "last": float(x[0])}


def measure(ops: int, trace: str | None) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.s13_record_memory", "--child", "--ops", str(ops)]
    if trace:
        command += ["--trace", trace]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=True)
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2_000_000)
    parser.add_argument("--no-hog", action="store_true", help="no CPU hog beside the program")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ops < 1:
        parser.error("--ops must be at least 1")
    if args.child:
        print(json.dumps(program(args.ops, args.trace)))
        return 0
    hog = None
    if not args.no_hog:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with tempfile.TemporaryDirectory(prefix="detctx-s13-") as folder:
            trace = str(Path(folder) / "tiny.trace")
            plain = measure(args.ops, None)
            recorded = measure(args.ops, trace)
            size = Path(trace).stat().st_size
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    above = recorded["peak_mb"] - plain["peak_mb"]
    beside = "a CPU hog beside it" if hog is not None else "no CPU hog"
    print(f"{args.ops} tiny ops (x = x + 1 on 4 float32), 1 torch thread, {beside}:")
    print(f"  unrecorded: peak RSS {plain['peak_mb']:.0f} MB, {plain['seconds']:.1f} s")
    print(f"  recorded:   peak RSS {recorded['peak_mb']:.0f} MB, {recorded['seconds']:.1f} s")
    met = "MET" if above <= TARGET_MB else "MISSED"
    print(f"  recording's peak above the program's own: {above:.0f} MB (target <= 500 MB) {met}")
    print(f"  trace: {size} bytes, {size / args.ops:.0f} bytes per op")
    return 0


if __name__ == "__main__":
    sys.exit(main())
