"""Scenario 15: what ``detctx.recording`` costs a training step, per model.

Each model is built from a config at a small size (the planting harness's four
families: HF GPT-2 and Llama, a ResNet-style CNN with BatchNorm, an LSTM
language model; and the nanoGPT step ``locate`` is measured on, at its three
sizes), one torch thread. A round runs ``--steps`` training steps (forward,
backward, AdamW) unrecorded, the same steps under a dispatch mode that only
forwards each op (the floor any op-by-op recording pays in torch), under one
that also copies each output (the floor of any recording that reads every
output's values op by op in Python), under one that only summarises each
output as the recording does (copies, statistics, digests, in line; none of
the recorder's data flow, call sites or module paths: what the trace's
arithmetic costs on this CPU), the same steps recorded into a trace
(opening, header and closing included), recorded with no helper thread (the
summaries in line, on the program's thread: what the helper saves, or does
not where the GIL runs its Python and the program's in turn), and recorded
with no summaries at all (no copies, rows or digests: what the recorder's
own work per op costs, its data flow, call sites, module paths and scalar
arguments, were the summaries free), in a rotating order; the rows are the
medians over the rounds. "Arithmetic alone" is the least the trace's
numbers cost: the plain step plus one digest of all the outputs' bytes and
the statistics rows of all their float32 numbers, laid end to end and cut
into pieces of 1 MiB, so no output costs a call of its own (measured apart,
after the rounds). The note says how many ops a step records and what each
costs beyond the plain step, and, for a model with a target, what the
target leaves each op beyond the plain step against what copying each
output already costs it.

Targets (issue 46): at most 2x on GPT-2, Llama, the LSTM and the CNN, at
most 1.5x on nanoGPT small.

``--profile MODEL`` prints where a recorded step's time goes instead (cProfile,
the 25 functions of most own time, the summaries included when no helper
thread runs).

    python -m benchmarks.s15_record_cost [--quick] [--models gpt2,llama] [--steps 3]
    python -m benchmarks.s15_record_cost --profile gpt2
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.harness import Result, Row, Settings, Table, Target, format_seconds, interleaved

SCENARIO = "15 record cost"
MODELS = ("gpt2", "llama", "lstm", "cnn", "nanogpt-tiny", "nanogpt-small", "nanogpt-shakespeare")
LIMITS = {"gpt2": 2.0, "llama": 2.0, "lstm": 2.0, "cnn": 2.0, "nanogpt-small": 1.5}
QUICK_MODELS = ("gpt2", "lstm", "nanogpt-tiny")


def build(name: str) -> tuple[Callable[[], None], str]:
    """A model's training step (seeded, built once) and its description."""
    if name.startswith("nanogpt-"):
        from benchmarks.gpt_step import GPT, SIZES, VOCAB

        size = SIZES[name.removeprefix("nanogpt-")]
        torch.manual_seed(0)
        gpt = GPT(size)
        idx = torch.randint(0, VOCAB, (size.batch, size.context))
        targets = torch.randint(0, VOCAB, (size.batch, size.context))
        optimiser = torch.optim.AdamW(gpt.parameters(), lr=1e-3)

        def gpt_step() -> None:
            optimiser.zero_grad(set_to_none=True)
            gpt(idx, targets).backward()
            optimiser.step()

        described = (
            f"nanoGPT {name.removeprefix('nanogpt-')} ({size.layers} layers, width "
            f"{size.width}, {size.batch}x{size.context} tokens)"
        )
        return gpt_step, described
    from benchmarks.planting_models import FAMILIES

    family = FAMILIES[name]
    model, batch = family.build(0)
    model.train()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        adamw.zero_grad(set_to_none=True)
        family.loss(model, batch).backward()
        adamw.step()

    return step, family.description


class _Forward:
    """A recorder that records nothing: each op is only forwarded."""

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return func(*args, **kwargs)


class _Copying:
    """A recorder that copies each op's tensor outputs (and lets the copy go), and nothing
    else: the least any recording that reads every output's values pays op by op in Python."""

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = func(*args, **kwargs)
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if type(value) is torch.Tensor:
                value.detach().clone()
        return result


class _Summarising:
    """A recorder that only summarises each op's tensor outputs as ``detctx.recording``
    does (copies, statistics rows, digests; in line, no helper thread) into a trace, and
    keeps nothing else: no data flow, call sites or module paths. What the trace's
    arithmetic costs on this CPU, whatever the recorder around it does."""

    def __init__(self, trace: Path) -> None:
        from detctx._compare.format import TraceWriter
        from detctx._compare.summaries import Summaries

        self.writer = TraceWriter(trace, dict)
        self.summaries = Summaries(self.writer, helper=lambda: False)

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = func(*args, **kwargs)
        values = result if isinstance(result, (tuple, list)) else (result,)
        outputs = [value for value in values if type(value) is torch.Tensor]
        if outputs:
            self.summaries.put(("op", "", "", "", ""), outputs, [])
        return result

    def close(self) -> None:
        self.summaries.close()
        self.writer.close()


@contextlib.contextmanager
def forwarding(recorder: Any = None) -> Iterator[None]:
    from detctx._locate import dispatch_mode

    mode = dispatch_mode(recorder or _Forward())
    with mode:
        yield


def contenders(step: Callable[[], None], steps: int, folder: Path) -> dict[str, Any]:
    import detctx

    trace = folder / "step.trace"

    def plain() -> None:
        for _ in range(steps):
            step()

    def forwarded() -> None:
        with forwarding():
            plain()

    def copied() -> None:
        with forwarding(_Copying()):
            plain()

    def summarised() -> None:
        summarising = _Summarising(trace)
        with forwarding(summarising):
            plain()
        summarising.close()
        trace.unlink()

    def recorded() -> None:
        with detctx.recording(trace):
            plain()
        trace.unlink()

    def in_line() -> None:
        with without_helper():
            recorded()

    def bookkeeping() -> None:
        with without_summaries():
            recorded()

    return {
        "plain": plain,
        "forwarding": forwarded,
        "copying": copied,
        "summarising": summarised,
        "recorded": recorded,
        "in line": in_line,
        "bookkeeping": bookkeeping,
    }


@contextlib.contextmanager
def without_helper() -> Iterator[None]:
    """Recordings made here summarise in line, on the program's thread, as where the process
    has no core to spare (the recorder asks ``spare_core`` at its first op)."""
    from detctx._compare import recorder

    asked = recorder.spare_core
    recorder.spare_core = lambda: False
    try:
        yield
    finally:
        recorder.spare_core = asked


@contextlib.contextmanager
def without_summaries() -> Iterator[None]:
    """Recordings made here keep no op's outputs: no copies, rows or digests, in line or on
    a helper (only the header is written). What the recorder's own work per op costs (data
    flow, call site, module path, scalar arguments): the least a recording costs were its
    summaries free."""
    from detctx._compare.summaries import Summaries

    put = Summaries.put

    def header_only(summaries: Summaries, *args: Any, **kwargs: Any) -> None:
        summaries.writer.begin()

    Summaries.put = header_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        Summaries.put = put  # type: ignore[method-assign]


class _Keeping:
    """A recorder that keeps a copy of the tensor outputs (CPU, strided) of each op a
    recording records (not views, copies or constants: ``op_info``'s ``skip``)."""

    def __init__(self) -> None:
        self.copies: list[torch.Tensor] = []

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from detctx._locate import op_info

        result = func(*args, **kwargs)
        if op_info(func).skip:
            return result
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if type(value) is torch.Tensor and value.is_cpu and value.layout == torch.strided:
                self.copies.append(value.detach().clone())
        return result


_PIECE: Final = 1 << 18
"""Numbers of a piece :func:`arithmetic` measures at a time (1 MiB of float32): large
enough that a call's own cost is small beside its arithmetic, small enough to stay in a
core's cache, as one output's copy does."""


def arithmetic(step: Callable[[], None], steps: int, repeat: int) -> float:
    """Seconds the trace's arithmetic takes for ``steps`` steps' outputs at the least: the
    digests of all their bytes and the statistics rows of all their float32 numbers, laid
    end to end and cut into pieces of :data:`_PIECE` numbers, so that no output costs a
    call of its own (median of ``repeat``)."""
    from detctx._compare.stacked import float_rows
    from detctx._locate import PUBLIC_KEY, tensor_digest

    keeping = _Keeping()
    with forwarding(keeping):
        step()
    every = torch.cat([copy.reshape(-1).view(torch.uint8) for copy in keeping.copies])
    floats = torch.cat([c.reshape(-1) for c in keeping.copies if c.dtype == torch.float32])
    keeping.copies.clear()
    numbers = list(floats.split(_PIECE))
    pieces = list(every.split(4 * _PIECE))
    timings = []
    for _ in range(repeat):
        started = time.perf_counter()
        for piece in pieces:
            tensor_digest(piece, key=PUBLIC_KEY, own=True)
        float_rows(numbers, own=True)
        timings.append(time.perf_counter() - started)
    return statistics.median(timings) * steps


def ops_per_step(step: Callable[[], None], folder: Path) -> int:
    import detctx
    from detctx._compare.reading import read_trace

    trace = folder / "count.trace"
    with detctx.recording(trace):
        step()
    count = len(read_trace(trace))
    trace.unlink()
    return count


def run(
    settings: Settings, models: tuple[str, ...] | None = None, steps: int | None = None
) -> Result:
    torch.set_num_threads(1)
    chosen = models or (QUICK_MODELS if settings.quick else MODELS)
    steps = steps or (1 if settings.quick else 3)
    repeat = 3 if settings.quick else 9
    rows: list[Row] = []
    lines: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="detctx-s15-") as name:
        folder = Path(name)
        for model in chosen:
            step, described = build(model)
            step()  # warm up: AdamW's state, allocator
            count = ops_per_step(step, folder)
            stats = interleaved(contenders(step, steps, folder), repeat)
            plain, recorded = stats["plain"], stats["recorded"]
            least = 1.0 + arithmetic(step, steps, repeat) / plain.median
            ops = max(count * steps, 1)
            per_op = (recorded.median - plain.median) / ops
            copying = (stats["copying"].median - plain.median) / ops
            limit = LIMITS.get(model)
            # What the target leaves each op beyond the plain step, against what a mode that
            # only copies each output already costs it.
            leaves = (limit - 1) * plain.median / ops if limit else None
            budget = (
                f"; the target leaves {leaves * 1e6:.0f} us an op, copying each output "
                f"costs {copying * 1e6:.0f}"
                if leaves is not None
                else ""
            )
            rows.append(
                Row(
                    SCENARIO,
                    f"{described}, {steps} step(s) recorded",
                    recorded,
                    "the same steps, unrecorded",
                    plain,
                    Target("ratio", limit) if limit else None,
                    note=(
                        f"{count} ops a step; {per_op * 1e6:.0f} us an op beyond the plain "
                        f"step; a mode that only forwards: "
                        f"{stats['forwarding'].median / plain.median:.2f}x, one that copies "
                        f"each output: {stats['copying'].median / plain.median:.2f}x, one "
                        f"that only summarises each output: "
                        f"{stats['summarising'].median / plain.median:.2f}x; the trace's "
                        f"arithmetic alone, with no per-output cost: {least:.2f}x; recorded "
                        f"with no helper thread: {stats['in line'].median / plain.median:.2f}x; "
                        f"with no summaries (the recorder's own work per op): "
                        f"{stats['bookkeeping'].median / plain.median:.2f}x{budget}"
                    ),
                )
            )
            lines.append(
                [
                    model,
                    str(count),
                    f"{plain.median * 1e3 / steps:.1f} ms",
                    f"{stats['forwarding'].median / plain.median:.2f}x",
                    f"{stats['copying'].median / plain.median:.2f}x",
                    f"{stats['summarising'].median / plain.median:.2f}x",
                    f"{least:.2f}x",
                    f"{recorded.median / plain.median:.2f}x",
                    f"{stats['in line'].median / plain.median:.2f}x",
                    f"{stats['bookkeeping'].median / plain.median:.2f}x",
                    f"{per_op * 1e6:.0f} us",
                    f"{leaves * 1e6:.0f} us" if leaves is not None else "-",
                ]
            )
    table = Table(
        "Recording cost per model",
        [
            "model",
            "ops a step",
            "plain step",
            "forwarding only",
            "copying each output",
            "summaries only",
            "arithmetic alone",
            "recorded",
            "recorded in line",
            "recorded, no summaries",
            "per op",
            "per op at the target",
        ],
        lines,
        note=f"{steps} step(s) a round, {repeat} rounds, medians; one torch thread",
    )
    return Result(rows, [table])


def profile(model: str, top: int = 25) -> None:
    import cProfile
    import pstats

    import detctx

    torch.set_num_threads(1)
    step, described = build(model)
    step()
    with tempfile.TemporaryDirectory(prefix="detctx-s15-") as name:
        trace = Path(name) / "profile.trace"
        with detctx.recording(trace):
            step()  # the first recording made its constants
        trace.unlink()
        profiler = cProfile.Profile()
        profiler.enable()
        with detctx.recording(trace):
            step()
        profiler.disable()
    print(f"# {described}: one recorded step, by own time")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, help="training steps a round (default 3)")
    parser.add_argument("--profile", metavar="MODEL", help="profile one recorded step")
    args = parser.parse_args(argv)
    if args.profile:
        if args.profile not in MODELS:
            parser.error(f"--profile takes one of {', '.join(MODELS)}")
        profile(args.profile)
        return 0
    models = tuple(args.models.split(",")) if args.models else None
    unknown = sorted(set(models or ()) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    result = run(Settings.make(args.quick), models, args.steps)
    for row in result.rows:
        value = format_seconds(row.value.median) if row.value else "-"
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        print(f"{row.subject}: {value} ({ratio}) [{row.status or '-'}]; {row.note}")
    for table in result.tables:
        print(f"{table.title} ({table.note})")
        print("  " + " | ".join(table.columns))
        for cells in table.rows:
            print("  " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
