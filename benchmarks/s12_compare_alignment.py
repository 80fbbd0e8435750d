"""Scenario 12: ``detctx compare`` when the two runs' ops do not line up.

Three pairs of traces, each recorded with ``detctx.recording`` and compared
with ``detctx.compare_traces``, timed against the same compare with the
alignment detctx used before (:func:`difflib_align`: difflib's longest
common blocks over the modules, then over the ops of each module), both in
one process, one torch thread:

- a loop of ``x = x + 1`` without modules (60,001 ops), B with one
  ``x = x * 1.0`` in the middle; target: the whole compare under 3 s. The
  difflib alignment took 11 s at 8,001 ops, 46 s at 16,001 and 281 s at
  32,001 (it grows faster than the square), so it runs here only up to
  ``--alternative-up-to`` ops (default 16,001): a row at 8,001 ops gives
  the ratio;
- an MLP (three linear layers, SGD) trained 3,000 steps (69,000 ops), B
  calling its hidden layer once more in step 1,500;
- the loop's trace against itself (every op pairs: both take the fast
  path).

A second table times ``align`` alone on the same pairs: what is left of
the compare is the rest of ``compare_traces`` (reading, the data flow, the
verdict).

    python -m benchmarks.s12_compare_alignment
    python -m benchmarks.s12_compare_alignment --ops 32001 --alternative-up-to 40000
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from torch import nn

from benchmarks.harness import Result, Row, Settings, Stats, Table, Target, format_seconds
from detctx._compare.align import Alignment, Partial
from detctx._compare.format import Trace

SCENARIO = "12 compare alignment"
TARGET_SECONDS = 3.0
ALTERNATIVE = "the same compare, difflib alignment (before)"


def loop(path: Path, ops: int, extra_at: int | None) -> None:
    """``x = x + 1`` ``ops`` times, no module; ``x = x * 1.0`` once more at ``extra_at``."""
    import detctx

    x = torch.ones(4)
    with detctx.recording(path):
        for step in range(ops):
            if step == extra_at:
                x = x * 1.0
            x = x + 1


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.hidden, self.last = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, again: bool = False) -> torch.Tensor:
        h = torch.tanh(self.hidden(torch.tanh(self.first(x))))
        if again:
            h = torch.tanh(self.hidden(h))
        return self.last(h)  # type: ignore[no-any-return]


def mlp(path: Path, steps: int, again_at: int | None) -> None:
    """An MLP trained ``steps`` steps with SGD; its hidden layer called twice at ``again_at``."""
    import detctx

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with detctx.recording(path):
        for step in range(steps):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x, again=step == again_at), y)
            loss.backward()
            optimizer.step()


def difflib_align(a: Trace, b: Trace) -> Alignment:
    """The alignment ``detctx compare`` used before: :class:`difflib.SequenceMatcher` over the
    segments (runs of ops in one module and pass), then over the ops of each matched pair."""

    def names(trace: Trace, column: str) -> list[str]:
        table = np.array(trace.strings, dtype=object)
        return list(table[trace.ops[column]]) if len(trace.ops) else []

    def segments(trace: Trace, modules: list[str]) -> tuple[list[tuple[str, bool]], np.ndarray]:
        if not modules:
            return [], np.zeros(1, dtype=np.int64)
        backward = np.zeros(len(trace), bool)
        if "" in trace.strings:
            backward = np.asarray(trace.ops["node"] != trace.strings.index(""))
        ids = np.unique(np.array(modules, dtype=object), return_inverse=True)[1]
        change = np.flatnonzero((np.diff(ids) != 0) | (np.diff(backward) != 0)) + 1
        starts = np.concatenate([[0], change, [len(modules)]]).astype(np.int64)
        return [(modules[s], bool(backward[s])) for s in starts[:-1]], starts

    names_a, names_b = names(a, "op"), names(b, "op")
    modules_a, modules_b = names(a, "module"), names(b, "module")
    partner = np.full(len(b), -1, dtype=np.int64)
    if names_a == names_b and modules_a == modules_b:
        partner[:] = np.arange(len(b))
        return Alignment(partner, [], [], [], [], (len(a), len(b)))
    keys_a, starts_a = segments(a, modules_a)
    keys_b, starts_b = segments(b, modules_b)
    merged: dict[tuple[str, bool], Partial] = {}
    seen_a, seen_b = set(), set()
    blocks = difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False).get_matching_blocks()
    for block in blocks:
        for offset in range(block.size):
            sa, sb = block.a + offset, block.b + offset
            seen_a.add(sa)
            seen_b.add(sb)
            lo_a, hi_a = int(starts_a[sa]), int(starts_a[sa + 1])
            lo_b, hi_b = int(starts_b[sb]), int(starts_b[sb + 1])
            ops_a, ops_b = names_a[lo_a:hi_a], names_b[lo_b:hi_b]
            if ops_a == ops_b:
                partner[lo_b:hi_b] = np.arange(lo_a, hi_a)
                continue
            aligned = 0
            inner = difflib.SequenceMatcher(None, ops_a, ops_b, autojunk=False)
            for op in inner.get_matching_blocks():
                start = lo_b + op.b
                partner[start : start + op.size] = np.arange(lo_a + op.a, lo_a + op.a + op.size)
                aligned += op.size
            known = merged.get(keys_b[sb], Partial(*keys_b[sb], 0, 0, 0))
            merged[keys_b[sb]] = Partial(
                *keys_b[sb],
                known.ops_a + hi_a - lo_a,
                known.ops_b + hi_b - lo_b,
                known.aligned + aligned,
            )
    missing_a = sorted({keys_a[i][0] for i in range(len(keys_a)) if i not in seen_a})
    missing_b = sorted({keys_b[i][0] for i in range(len(keys_b)) if i not in seen_b})
    paired = int((partner >= 0).sum())
    return Alignment(
        partner,
        list(merged.values()),
        missing_a,
        missing_b,
        [],  # the alignment before had no rule for fused modules
        (paired, paired),
    )


@contextmanager
def aligned_with(function: Callable[[Trace, Trace], Alignment]) -> Iterator[None]:
    """``compare_traces`` with ``function`` as its alignment."""
    import detctx._compare.compare as compare

    saved = compare.align
    compare.align = function
    try:
        yield
    finally:
        compare.align = saved


def timed(run: Callable[[], object], repeat: int) -> Stats:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return Stats.of(samples, 1)


def measure(label: str, a: Path, b: Path, repeat: int, alternative: bool) -> tuple[Row, list[str]]:
    """The compare of ``a`` and ``b``, and ``align`` alone, with each alignment."""
    import detctx
    from detctx._compare.align import align

    def compare() -> object:
        return detctx.compare_traces(a, b)

    compared = detctx.compare_traces(a, b).ranks[0]
    trace_a, trace_b, found = compared.a, compared.b, compared.alignment
    now = timed(compare, repeat)
    alone = timed(lambda: align(trace_a, trace_b), repeat)
    before = before_alone = None
    if alternative:
        with aligned_with(difflib_align):
            before = timed(compare, 1)
        before_alone = timed(lambda: difflib_align(trace_a, trace_b), 1)
        agreed = np.array_equal(found.partner, difflib_align(trace_a, trace_b).partner)
    note = f"{len(trace_a):,} and {len(trace_b):,} ops, {found.aligned:,} paired" + (
        "" if not alternative else f" ({'the same' if agreed else 'other'} pairs as difflib)"
    )
    row = Row(
        SCENARIO,
        f"compare_traces, {label}",
        now,
        ALTERNATIVE if alternative else None,
        before,
        Target("seconds", TARGET_SECONDS),
        note=note,
    )
    cells = [
        label,
        format_seconds(alone.median),
        "-" if before_alone is None else format_seconds(before_alone.median),
        "-" if before_alone is None else f"{before_alone.median / alone.median:.0f}x",
    ]
    return row, cells


def run(settings: Settings, ops: int = 60_001, steps: int = 3_000, limit: int = 16_001) -> Result:
    """The rows for ``benchmarks/run_all.py`` (a few thousand ops when quick)."""
    if settings.quick:
        ops, steps, small = 2_001, 100, 1_001
    else:
        small = 8_001
    repeat = 3 if settings.quick else 5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows, cells = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="detctx-s12-") as name:
            folder = Path(name)
            pairs: list[tuple[str, Path, Path, bool]] = []
            for count in (ops, small):
                a, b = folder / f"loop{count}-a.trace", folder / f"loop{count}-b.trace"
                loop(a, count - 1, None)
                loop(b, count - 1, (count - 1) // 2)
                label = f"{count - 1:,} ops without modules, one extra op in the middle"
                pairs.append((label, a, b, count <= limit))
            a, b = folder / "mlp-a.trace", folder / "mlp-b.trace"
            mlp(a, steps, None)
            mlp(b, steps, steps // 2)
            pairs.append((f"MLP, {steps:,} steps, one extra layer call", a, b, True))
            same = folder / f"loop{ops}-a.trace"
            pairs.append((f"the {ops - 1:,}-op loop against itself", same, same, True))
            for label, a, b, alternative in pairs:
                row, line = measure(label, a, b, repeat, alternative)
                rows.append(row)
                cells.append(line)
    finally:
        torch.set_num_threads(threads)
    table = Table(
        "align() alone (12 compare alignment)",
        ["traces", "align", "difflib alignment", "ratio"],
        cells,
        note=f"difflib alignment run up to {limit:,} ops (281 s at 32,001 ops).",
    )
    return Result(rows, [table])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=60_001, help="ops in the loop's trace B")
    parser.add_argument("--steps", type=int, default=3_000, help="the MLP's training steps")
    parser.add_argument(
        "--alternative-up-to",
        type=int,
        default=16_001,
        help="run the difflib alignment on loops of at most this many ops",
    )
    parser.add_argument("--quick", action="store_true", help="a few thousand ops")
    args = parser.parse_args(argv)
    result = run(Settings.make(args.quick), args.ops, args.steps, args.alternative_up_to)
    for row in result.rows:
        line = f"{row.subject}: {format_seconds(row.value.median) if row.value else '-'}"
        if row.baseline is not None and row.ratio is not None:
            line += f", before {format_seconds(row.baseline.median)} ({row.ratio:.3f}x)"
        print(f"{line} [{row.status}]; {row.note}")
    for table in result.tables:
        print(table.title)
        for cells in table.rows:
            print("  " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
