"""``detctx compare A B`` on two recorded runs (traces, or folders of rank traces).

A file is taken for a trace by its first bytes, a folder by its
``rank<N>.trace`` files; anything else is a metric log, compared as before.
Exit status 0 when every op is within tolerance, 1 when not, 2 when the
traces cannot be compared (a damaged or cut file, different programs).
``--json`` prints :meth:`TraceComparison.as_dict`; ``--plot`` draws each
op's estimated error along the run on a log scale, with the tolerance, the
origin, and the backward passes and updates shaded.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from detctx._cli.plotting import load_pyplot

if TYPE_CHECKING:
    import numpy as np

    from detctx._compare import TraceComparison

__all__ = [
    "NOT_FINITE",
    "SAME_BITS",
    "compare_recorded",
    "looks_like_trace",
    "phases",
    "plot_errors",
]

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


SAME_BITS: Final = 1e-18
"""Where an op whose outputs have the same bits (error 0) is drawn, in every plot."""
NOT_FINITE: Final = 1e4
"""Where an op whose count of NaN or Inf differs (error inf) is drawn, in every plot."""
_SMALLEST, _LARGEST = 1e-17, 1e3
"""Errors are drawn between these, so the two rows above stay apart from them."""

_PHASES: Final = (
    ("backward", "#4c72b0", "backward pass (ops of an autograd node)"),
    ("update", "#dd8452", "after backward, outside modules (optimizer step, clipping, ...)"),
)


def phases(trace_ops: np.ndarray, strings: list[str]) -> dict[str, np.ndarray]:
    """For each op of a trace, whether it ran in the backward pass (it has an autograd
    node) or after one, outside any module and without a node: the update. The rest is
    the forward pass. The optimizer is not recorded as such: its ops carry the line that
    called ``step()``, as any top-level op does."""
    import numpy as np  # here: `detctx run` imports this module, and neither torch nor NumPy

    empty = np.array([text == "" for text in strings], dtype=bool)
    backward = ~empty[trace_ops["node"]]
    outside = empty[trace_ops["module"]] & ~backward
    update = np.zeros(len(trace_ops), dtype=bool)
    after_backward = False
    for index in range(len(trace_ops)):
        if backward[index]:
            after_backward = True
        elif not outside[index]:
            after_backward = False
        else:
            update[index] = after_backward
    return {"backward": backward, "update": update}


def plot_errors(result: TraceComparison, path: Path) -> None:
    """Each op's estimated error along B's run (log scale), its tolerance, the origin, and
    the backward passes and updates shaded (:func:`error_figure`), written to ``path``."""
    pyplot = load_pyplot()
    figure = error_figure(result)
    try:
        figure.savefig(path)
    finally:
        pyplot.close(figure)


def error_figure(result: TraceComparison) -> Any:
    """The figure :func:`plot_errors` writes (the caller closes it). The rows for same
    bits and for a NaN or Inf count that differs are at the same height in every plot."""
    import numpy as np

    from detctx._cli.curves import short_names

    pyplot = load_pyplot()
    figure, axes = pyplot.subplots(figsize=(10, 6.5))
    try:
        origin = result.origin
        marked = next((r for r in result.ranks if origin and r.rank == origin.rank), None)
        marked = marked or (result.ranks[0] if result.ranks else None)
        if marked is not None:
            spans = phases(marked.b.ops, marked.b.strings)
            x = np.arange(len(marked.b.ops))
            for phase, colour, label in _PHASES:
                axes.fill_between(
                    x,
                    0,
                    1,
                    where=spans[phase],
                    step="mid",
                    color=colour,
                    alpha=0.12,
                    linewidth=0,
                    transform=axes.get_xaxis_transform(),
                    label=f"{label}, rank {marked.rank}" if len(result.ranks) > 1 else label,
                )
        for number, rank in enumerate(result.ranks):
            colour = f"C{number % 10}"
            error = rank.error.astype(float)
            indices = np.flatnonzero(~np.isnan(error))
            shown = np.where(
                error[indices] == 0,
                SAME_BITS,
                np.where(
                    np.isinf(error[indices]), NOT_FINITE, error[indices].clip(_SMALLEST, _LARGEST)
                ),
            )
            axes.plot(
                indices, shown, ".", markersize=3, color=colour, label=f"error, rank {rank.rank}"
            )
            tolerance = np.where(rank.tolerance > 0, rank.tolerance.astype(float), np.nan)
            axes.plot(
                np.arange(len(tolerance)),
                tolerance.clip(_SMALLEST, _LARGEST),
                "--",
                drawstyle="steps-mid",
                linewidth=1,
                color=colour,
                alpha=0.6,
                label=f"tolerance, rank {rank.rank} (ops with float outputs)",
            )
        axes.axhline(SAME_BITS, color="grey", linestyle=":", linewidth=1)
        axes.axhline(NOT_FINITE, color="grey", linestyle=":", linewidth=1)
        if origin is not None:
            at = (
                NOT_FINITE
                if math.isinf(origin.error)
                else min(max(origin.error, _SMALLEST), _LARGEST)
            )
            axes.plot(
                [origin.index],
                [at],
                "o",
                color="red",
                markersize=10,
                fillstyle="none",
                label="origin",
            )
            axes.annotate(
                f"{origin.op}\n{origin.module_path or '(top level)'}\n{origin.source}",
                (origin.index, at),
                textcoords="offset points",
                xytext=(12, -34),
                fontsize=8,
            )
        axes.set_yscale("log")
        axes.set_ylim(SAME_BITS / 10, NOT_FINITE * 10)
        ticks = [SAME_BITS, *(10.0**power for power in range(-15, 4, 3)), NOT_FINITE]
        axes.set_yticks(ticks)
        axes.set_yticklabels(
            ["same bits", *(f"1e{power}" for power in range(-15, 4, 3)), "NaN/Inf differ"]
        )
        axes.set_xlabel("op of B, in the order it ran (unshaded: forward pass)")
        axes.set_ylabel("estimated relative error")
        verdict = (
            "bit for bit"
            if result.bitwise
            else "within tolerance"
            if result.agree
            else (f"{len(result.past_tolerance)} ops past tolerance")
        )
        a, b = short_names([result.a, result.b])
        axes.set_title(f"{a} against {b}: {verdict}", fontsize=9)
        axes.legend(
            fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False
        )
        figure.tight_layout()
    except BaseException:
        pyplot.close(figure)
        raise
    return figure
