"""``detctx run --locate``: record an op trace in each run and name the first op where they part.

Each run gets ``$DETCTX_LOCATE_TRACE`` (its trace file) and a folder on
``PYTHONPATH`` whose ``sitecustomize`` starts recording when Python starts
(:mod:`detctx._locate.child`), then runs any ``sitecustomize`` it hides. So
``python train.py`` records unchanged, as does a shell script or launcher
whose first Python process imports the detctx installed with it. A command
that starts no such Python process (a binary, ``python -I`` or ``-S``)
writes no trace, and that is reported, not guessed around. The traces are
kept as ``runN.trace`` in ``--log-dir`` when given, else in a temporary
folder removed afterwards (or by the next recording, if this one is killed:
see :mod:`detctx._basics.scratch`); they are read back as untrusted input. In
``--log-dir`` the shim gets a folder of its own that detctx creates
(``detctx-site-`` and eight random characters), and only what detctx put there is removed (see
:mod:`detctx._cli.paths`).

Nothing here imports torch before the runs: ``detctx run`` keeps torch out of
its own process (see :mod:`detctx._environment.switches`); comparing the traces at
the end does.
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from detctx._basics import Scratch, TraceError, scratch_folder
from detctx._cli.curves import Curve, CurveComparison, compare
from detctx._cli.paths import refuse_link, remove_created

if TYPE_CHECKING:
    from detctx._locate import Divergence

__all__ = ["TRACE_ENV", "Tracing", "recording_shim", "report_located"]

TRACE_ENV: Final = "DETCTX_LOCATE_TRACE"
"""The variable :mod:`detctx._locate.child` records into (the same name; importing it from
there would import torch)."""
KEY_ENV: Final = "DETCTX_LOCATE_KEY"
"""The variable that hands every run the digest key (:mod:`detctx._locate.keys`)."""

def recording_shim(writer: str, label: str, variable: str, module: str) -> str:
    """A ``sitecustomize`` that starts ``module``'s recording when ``variable`` is set, then
    runs the ``sitecustomize`` it hides; ``writer`` and ``label`` name the command in it."""
    return f'''\
"""Written by {writer}: record this process's ops, then the hidden sitecustomize."""
import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("{variable}"):
    try:
        from {module} import start_from_environment

        start_from_environment()
    except Exception as exc:
        sys.stderr.write(f"detctx: {label} cannot record this process: {{exc!r}}\\n")

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
'''


_SHIM: Final = recording_shim("detctx run --locate", "--locate", TRACE_ENV, "detctx._locate")


class Tracing:
    """The traces of one ``detctx run --locate``: where they go, and what they say."""

    def __init__(self, folder: Path, *, scratch: Scratch | None = None) -> None:
        self.folder = folder
        self.temporary = scratch is not None
        self.site = Path(tempfile.mkdtemp(prefix="detctx-site-", dir=folder))
        # Removed by close(), or at exit when a run failed before the report.
        self._cleanup = weakref.finalize(self, _clean_up, self.site, scratch)
        descriptor = os.open(self.site / "sitecustomize.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with open(descriptor, "w", encoding="utf-8") as shim:
            shim.write(_SHIM)
        self.runs = 0
        # One secret key for every run's digests, from the OS's entropy (no seeded
        # generator moves): a program that does not read it cannot craft a collision.
        self._key = secrets.token_hex(16)

    @classmethod
    def start(cls, log_dir: Path | None) -> Tracing:
        if log_dir is None:
            # Locked while this process lives: the next recording removes it if this one
            # is killed before removing it itself.
            scratch = scratch_folder()
            return cls(scratch.path, scratch=scratch)
        log_dir.mkdir(parents=True, exist_ok=True)
        return cls(log_dir)

    def check(self, runs: int) -> None:
        """Refuse, before the first run, a trace path that is a link someone planted."""
        for index in range(1, runs + 1):
            refuse_link(self.trace(index))

    def trace(self, index: int) -> Path:
        return self.folder / f"run{index}.trace"

    def env_for(self, index: int, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` for run ``index`` (1-based): its trace file and the recording shim."""
        path = self.trace(index)
        refuse_link(path)
        path.unlink(missing_ok=True)  # an earlier run's trace: the child creates its own
        self.runs = max(self.runs, index)
        run_env = dict(env)
        run_env[TRACE_ENV] = str(path.resolve())
        run_env[KEY_ENV] = self._key
        rest = run_env.get("PYTHONPATH", "")
        run_env["PYTHONPATH"] = str(self.site.resolve()) + (os.pathsep + rest if rest else "")
        return run_env

    def locate(self) -> Divergence | None:
        """The first op where a run parts from run 1, or ``None`` when every trace agrees."""
        from detctx._locate import compare_traces

        for index in range(1, self.runs + 1):
            if not self.trace(index).is_file():
                raise TraceError(
                    f"run {index} wrote no op trace: --locate records the first Python "
                    "process the command starts, through a sitecustomize on PYTHONPATH; this "
                    "command started none that could import detctx (not Python, python -I or "
                    "-S, or another environment without detctx)"
                )
        for index in range(2, self.runs + 1):
            found = compare_traces(self.trace(1), self.trace(index), index)
            if found is not None:
                return found
        return None

    def close(self) -> None:
        """Remove the shim, and the traces too when they live in a temporary folder."""
        self._cleanup()

    def report(self, curves: list[Curve], report: Callable[[CurveComparison], int]) -> int:
        """Locate the first differing op, print it beside the curves' report; then close."""
        try:
            return report_located(self.locate(), curves, report)
        finally:
            self.close()


def _clean_up(site: Path, scratch: Scratch | None) -> None:
    if scratch is not None:
        scratch.close()  # detctx made the folder, and all in it
    else:
        _remove_site(site)


def _remove_site(site: Path) -> None:
    """Remove the shim and the bytecode Python compiled from it, nothing else."""
    cache = site / "__pycache__"
    if cache.is_dir() and not cache.is_symlink():
        remove_created(cache, [entry.name for entry in cache.glob("sitecustomize.*.pyc")])
    left = remove_created(site, ["sitecustomize.py"])
    if left:
        sys.stderr.write(
            f"detctx: left {site} in place: it holds {', '.join(left)}, which detctx did not "
            "put there\n"
        )


def report_located(
    found: Divergence | None, curves: list[Curve], report: Callable[[CurveComparison], int]
) -> int:
    """Print the curves' comparison (when every run printed a metric) and the located op.

    Exit status 1 when either the curves or the op traces differ; curves that differ
    while every op agreed are said to differ through values from outside torch ops.
    """
    status = 0
    if all(curve.points for curve in curves):
        status = report(compare(curves))
    else:
        print("no metric lines in the output: comparing the op traces only")
    if found is None:
        same = f"op traces: all {len(curves)} runs ran the same ops with the same bits"
        if not status:
            print(f"{same}.")
            return status
        print(
            f"{same}, yet the metric curves differ: the difference came from outside torch "
            "ops, from data (NumPy, Python, a file, OS entropy) that reached the printed "
            "metric without an op computing from it (only copied, viewed or filled in, which "
            "is not recorded), or from a metric computed without torch."
        )
        return status
    print(f"op traces: {found}")
    return 1
