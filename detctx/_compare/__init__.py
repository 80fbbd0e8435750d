"""Where two environments part: record a run once with per-op statistics, compare it with
another device's, release's or cluster's run within tolerance.

``detctx.recording(path)`` (and ``detctx record``, through
:func:`start_from_environment`) writes a trace: per recorded op its module
path, source line, digest, each output's statistics and sketch, and which
earlier op made each input. ``detctx.compare_traces(a, b)`` aligns two
traces module by module and op by op, estimates each op's error from the
sketches, and names the first op whose error its inputs do not explain.
"""

from __future__ import annotations

from detctx._compare.compare import TOLERANCES
from detctx._compare.findings import BitsPart, OpError, UnpairedOps
from detctx._compare.reading import is_trace
from detctx._compare.report import TraceComparison, compare_traces
from detctx._compare.session import RECORD_ENV, recording, start_from_environment

__all__ = [
    "RECORD_ENV",
    "TOLERANCES",
    "BitsPart",
    "OpError",
    "TraceComparison",
    "UnpairedOps",
    "compare_traces",
    "is_trace",
    "recording",
    "start_from_environment",
]
