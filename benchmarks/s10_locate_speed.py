"""Scenario 10: ``locate_divergence`` at the speed of training, on a nanoGPT-style step.

``locate_divergence(step, runs=2)`` records every op of two runs of a step
(``benchmarks/gpt_step.py``: embeddings, ``nn.MultiheadAttention`` with
dropout, MLP, two AdamW steps) and compares them; it is timed against two
plain ``deterministic(seed=7)`` runs of the same step, interleaved in one
process, one torch thread. Targets: at most 1.3x at the small and
shakespeare sizes, 2x at tiny. ``--cli`` times ``detctx run --locate -n 2``
against ``detctx run -n 2`` on a script that trains the step; ``--rss``
measures the peak RSS of one run with and without recording, each in a fresh
process; ``--digest`` measures the digest's throughput (on the GPU too,
where there is one).

    python -m benchmarks.s10_locate_speed --sizes tiny,small --repeat 5
    python -m benchmarks.s10_locate_speed --sizes small --cli --repeat 3
    python -m benchmarks.s10_locate_speed --sizes shakespeare --repeat 1 --rss
    python -m benchmarks.s10_locate_speed --device cuda --sizes small,shakespeare --digest
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.gpt_step import SIZES, train_step
from benchmarks.harness import Result, Row, Settings, Stats, Target, format_seconds, interleaved

SCENARIO = "10 locate speed"
ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"tiny": 2.0, "small": 1.3, "shakespeare": 1.3}

_RSS_SCRIPT = """
import resource, sys, tempfile, pathlib, torch, detctx
from benchmarks.gpt_step import SIZES, train_step
torch.set_num_threads(1)
size, record = SIZES[sys.argv[1]], sys.argv[2] == "recorded"
with detctx.deterministic(seed=7):
    if record:
        from detctx._locate.recorder import OpRecorder
        from detctx._locate.trace import TraceWriter
        writer = TraceWriter(pathlib.Path(tempfile.mkdtemp()) / "run.trace")
        recorder = OpRecorder(writer)
        recorder.start()
    train_step(size)
    if record:
        recorder.stop()
        writer.close()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def in_process(size_name: str, repeat: int, device: str) -> dict[str, Stats]:
    import detctx

    size = SIZES[size_name]

    def plain() -> None:
        for _ in range(2):
            with detctx.deterministic(seed=7):
                train_step(size, device=device)

    def located() -> None:
        found = detctx.locate_divergence(train_step, size, runs=2, seed=7, device=device)
        if found is not None:
            raise AssertionError(f"the runs of the benchmark step parted: {found}")

    return interleaved({"two plain runs": plain, "locate, runs=2": located}, repeat)


def per_op_floor(size_name: str, repeat: int) -> dict[str, Stats]:
    """One run of the step: plain, under a dispatch mode that only calls each op, recorded."""
    import tempfile

    import detctx
    from detctx._locate.recorder import OpRecorder, dispatch_mode_class
    from detctx._locate.trace import TraceWriter

    size = SIZES[size_name]
    base = dispatch_mode_class()

    class Bare(base):  # type: ignore[misc, valid-type]
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        def __torch_dispatch__(
            self,
            func: Callable[..., object],
            types: object,
            args: tuple = (),
            kwargs: dict | None = None,
        ) -> object:
            return func(*args, **(kwargs or {}))

    folder = Path(tempfile.mkdtemp(prefix="detctx-bench-"))

    def plain() -> None:
        with detctx.deterministic(seed=7):
            train_step(size)

    def bare() -> None:
        with detctx.deterministic(seed=7), Bare():
            train_step(size)

    def recorded() -> None:
        writer = TraceWriter(folder / "run.trace")
        try:
            with detctx.deterministic(seed=7):
                recorder = OpRecorder(writer)
                recorder.start()
                try:
                    train_step(size)
                finally:
                    recorder.stop()
        finally:
            writer.close()

    return interleaved(
        {"plain": plain, "bare dispatch mode": bare, "recorded to a trace": recorded}, repeat
    )


def _command(size_name: str, locate: bool) -> list[str]:
    options = ["--locate"] if locate else []
    script = [sys.executable, "-m", "benchmarks.gpt_step", size_name]
    return [sys.executable, "-m", "detctx", "run", "-n", "2", *options, "--", *script]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + rest if rest else "")
    return env


def cli(size_name: str, repeat: int) -> dict[str, Stats]:
    env = _environment()

    def runner(locate: bool) -> Callable[[], None]:
        def run() -> None:
            done = subprocess.run(
                _command(size_name, locate), cwd=ROOT, env=env, capture_output=True, text=True
            )
            if done.returncode != 0:
                raise AssertionError(f"detctx run failed:\n{done.stdout}\n{done.stderr}")

        return run

    return interleaved(
        {"detctx run -n 2": runner(False), "detctx run -n 2 --locate": runner(True)}, repeat
    )


def peak_rss(size_name: str) -> dict[str, int]:
    """Peak RSS in KiB of one run of the step, unrecorded and recorded, each a fresh process."""
    peaks = {}
    for mode in ("plain", "recorded"):
        done = subprocess.run(
            [sys.executable, "-c", _RSS_SCRIPT, size_name, mode],
            cwd=ROOT,
            env=_environment(),
            capture_output=True,
            text=True,
            check=True,
        )
        peaks[mode] = int(done.stdout.split()[-1])
    return peaks


def digest_speed(device: str) -> list[tuple[str, float, float]]:
    """``(size, digest ns/byte, tensor.sum ns/byte)`` for float32 tensors on ``device``."""
    from detctx._locate.digest import digest

    rows = []
    for label, numel in (("64 KiB", 1 << 14), ("4 MiB", 1 << 20), ("256 MiB", 1 << 26)):
        tensor = torch.randn(numel, device=device)

        def timed(fn: Callable[[], object], tensor: torch.Tensor = tensor) -> float:
            fn()
            times = []
            for _ in range(7):
                start = time.perf_counter()
                fn()
                if tensor.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            return statistics.median(times) / (tensor.numel() * 4) * 1e9

        rows.append(
            (label, timed(lambda t=tensor: digest(t)), timed(lambda t=tensor: t.sum().item()))
        )
    return rows


def run(settings: Settings) -> Result:
    """The in-process rows for ``benchmarks/run_all.py`` (tiny only when quick)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for name in ("tiny",) if settings.quick else ("tiny", "small"):
            stats = in_process(name, 3 if settings.quick else 5, "cpu")
            rows.append(
                Row(
                    SCENARIO,
                    f"locate_divergence(step, runs=2), {name} GPT {tuple(SIZES[name][:4])}",
                    stats["locate, runs=2"],
                    "two plain deterministic(seed=7) runs of the step",
                    stats["two plain runs"],
                    Target("ratio", TARGETS[name]),
                    note="(width, layers, context, batch); two AdamW steps per run",
                )
            )
    finally:
        torch.set_num_threads(threads)
    return Result(rows)


def _line(label: str, stats: dict[str, Stats], base: str, other: str, target: float) -> str:
    ratio = stats[other].median / stats[base].median
    status = "met" if ratio <= target else "missed"
    return (
        f"| {label} | {format_seconds(stats[base].median)} | "
        f"{format_seconds(stats[other].median)} | {ratio:.2f}x | <= {target:g}x, {status} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small", help=f"of {', '.join(SIZES)}")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds per contender")
    parser.add_argument("--device", default="cpu", help="where the step runs (cpu, cuda)")
    parser.add_argument("--cli", action="store_true", help="also time detctx run --locate")
    parser.add_argument("--cli-only", action="store_true", help="time detctx run --locate only")
    parser.add_argument("--rss", action="store_true", help="also measure peak RSS")
    parser.add_argument("--digest", action="store_true", help="also time the digest alone")
    parser.add_argument(
        "--per-op", action="store_true", help="also time one run under a bare dispatch mode"
    )
    args = parser.parse_args(argv)
    sizes = [name.strip() for name in args.sizes.split(",") if name.strip()]
    unknown = [name for name in sizes if name not in SIZES]
    if unknown or args.repeat < 1:
        parser.error(f"sizes must be among {list(SIZES)} and --repeat at least 1")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread, {args.device}, {args.repeat} rounds, medians")
    print("| model (width, layers, context, batch) | baseline | with locate | ratio | target |")
    print("| --- | --- | --- | --- | --- |")
    for name in sizes:
        if not args.cli_only:
            stats = in_process(name, args.repeat, args.device)
            label = f"{name} {tuple(SIZES[name][:4])}: locate_divergence(runs=2) vs two plain runs"
            line = _line(label, stats, "two plain runs", "locate, runs=2", TARGETS[name])
            print(line, flush=True)
        if args.cli or args.cli_only:
            stats = cli(name, args.repeat)
            label = f"{name}: detctx run -n 2 --locate vs detctx run -n 2"
            print(_line(label, stats, "detctx run -n 2", "detctx run -n 2 --locate", TARGETS[name]))
    if args.per_op:
        for name in sizes:
            stats = per_op_floor(name, args.repeat)
            base = stats["plain"].median
            print(
                f"one run of {name}: "
                + ", ".join(
                    f"{label} {format_seconds(value.median)} ({value.median / base:.2f}x)"
                    for label, value in stats.items()
                )
            )
    if args.rss:
        for name in sizes:
            peaks = peak_rss(name)
            print(
                f"peak RSS, one run of {name}: {peaks['plain'] / 1024:.0f} MiB unrecorded, "
                f"{peaks['recorded'] / 1024:.0f} MiB recorded "
                f"(+{(peaks['recorded'] - peaks['plain']) / 1024:.0f} MiB)"
            )
    if args.digest:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        for device in devices:
            for label, ours, summed in digest_speed(device):
                print(
                    f"digest of {label} float32 on {device}: {ours:.3f} ns/byte "
                    f"(tensor.sum: {summed:.3f} ns/byte)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
