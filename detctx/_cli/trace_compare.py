"""``detctx compare A B`` on two recorded runs (traces, or folders of rank traces).

A file is taken for a trace by its first bytes, a folder by its
``rank<N>.trace`` files; anything else is a metric log, compared as before.
Exit status 0 when every op is within tolerance, 1 when not, 2 when the
traces cannot be compared (a damaged or cut file, different programs).
``--json`` prints :meth:`TraceComparison.as_dict`; ``--plot`` draws each
op's estimated error along the run on a log scale, with the tolerance and
the origin.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

from detctx._cli.plotting import load_pyplot

if TYPE_CHECKING:
    from detctx._compare import TraceComparison

__all__ = ["compare_recorded", "looks_like_trace", "plot_errors"]

MAGIC: Final = b"DETCTXST"
""":data:`detctx._compare.format.MAGIC` (importing it from there would import torch)."""


def looks_like_trace(path: Path) -> bool:
    """Whether ``path`` is a statistics trace, or a folder holding rank traces."""
    if path.is_dir():
        return any(looks_like_trace(child) for child in sorted(path.glob("rank*.trace")))
    if not path.is_file():
        return False  # a FIFO would block the open; the log reader refuses it with a reason
    try:
        with open(path, "rb") as stream:
            return stream.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def compare_recorded(
    a: Path,
    b: Path,
    *,
    rtol: float | None,
    atol: float | None,
    as_json: bool,
    plot_path: Path | None,
) -> int:
    """Compare, print, plot; the exit status (a :class:`~detctx.TraceError` is the caller's)."""
    from detctx._compare import compare_traces

    result = compare_traces(a, b, rtol=rtol, atol=atol)
    if as_json:
        print(json.dumps(result.as_dict(), indent=2, default=str))
    else:
        print(result.format())
    if plot_path is not None:
        try:
            plot_errors(result, plot_path)
        except (ValueError, OSError) as exc:
            sys.stderr.write(f"detctx: error: the plot could not be written: {exc}\n")
        else:
            if not as_json:
                print(f"plot written to {plot_path}")
    return 0 if result.agree else 1


def plot_errors(result: TraceComparison, path: Path) -> None:
    """Each op's estimated error along B's run (log scale), its tolerance, the origin."""
    pyplot = load_pyplot()
    figure, axes = pyplot.subplots(figsize=(10, 5))
    try:
        errors = [e for r in result.ranks for e in r.error.tolist() if e > 0 and math.isfinite(e)]
        # Same bits (0) and a NaN or Inf count that differs (inf) have no place on a log
        # scale: they are drawn at the bottom and the top.
        floor = min(errors, default=1e-8) / 10
        ceiling = max(errors, default=1.0) * 10
        for number, rank in enumerate(result.ranks):
            colour = f"C{number % 10}"
            indices = [i for i, e in enumerate(rank.error.tolist()) if not math.isnan(e)]
            shown = [min(max(float(rank.error[i]), floor), ceiling) for i in indices]
            axes.plot(indices, shown, ".", markersize=2, color=colour, label=f"rank {rank.rank}")
            bounded = [i for i in indices if rank.tolerance[i] > 0]
            axes.plot(
                bounded,
                [min(max(float(rank.tolerance[i]), floor), ceiling) for i in bounded],
                "_",
                markersize=3,
                color="grey",
                label=f"rank {rank.rank} tolerance (float outputs)",
            )
        origin = result.origin
        if origin is not None:
            at = min(float(origin.error), ceiling)
            axes.plot(
                [origin.index],
                [at],
                "o",
                color="red",
                markersize=9,
                fillstyle="none",
                label="origin",
            )
            axes.annotate(
                f"{origin.op}\n{origin.module_path}\n{origin.source}",
                (origin.index, at),
                textcoords="offset points",
                xytext=(10, 10),
                fontsize=8,
            )
        axes.set_yscale("log")
        axes.set_xlabel("op of B, in the order it ran")
        axes.set_ylabel(f"estimated relative error (same bits at {floor:.0e})")
        verdict = (
            "bit for bit"
            if result.bitwise
            else "within tolerance"
            if result.agree
            else (f"{len(result.past_tolerance)} ops past tolerance")
        )
        axes.set_title(f"{result.a} against {result.b}: {verdict}", fontsize=9)
        axes.legend(fontsize=8, loc="lower right")
        figure.tight_layout()
        figure.savefig(path)
    finally:
        pyplot.close(figure)
