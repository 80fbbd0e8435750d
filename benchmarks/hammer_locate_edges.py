"""Hammer ``locate_divergence`` where it used to crash, part identical runs, call runs that
differ identical, or leave its scratch folder behind (issue 34, items 2, 3 and 7).

    python benchmarks/hammer_locate_edges.py --trials 20 --kills 5

Counts, over ``--trials`` calls each: recordings through a strided nested
tensor that raised; identical runs through a jagged one that were reported
as parted; runs whose result differs only through NumPy data that is cloned
(``lambda: torch.from_numpy(rng.random(4)).clone()``) reported as agreeing.
Then, ``--kills`` times for each of SIGKILL, SIGTERM and ``os._exit``, a
child process recording is killed mid-run; the ``detctx-locate-*`` folders
left in its temporary directory are counted before and after the next
recording. Uses the public API only, so any version of detctx can be
measured (``PYTHONPATH=<checkout>``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

import detctx

_CHILD = """
import os, signal, sys, torch, detctx
how = sys.argv[1]
def step():
    torch.ones(3).sin()
    if how == "SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "SIGTERM":
        os.kill(os.getpid(), signal.SIGTERM)
    os._exit(3)
detctx.locate_divergence(step)
"""


def _nested(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = [torch.randn(2, 3), torch.randn(4, 3)]
        return torch.nested.nested_tensor(parts, layout=layout)


def nested_runs(trials: int) -> tuple[int, int]:
    """(strided recordings that raised, jagged identical runs reported as parted)."""
    raised = parted = 0
    for _ in range(trials):
        try:
            detctx.locate_divergence(lambda: (_nested(torch.strided) * 2).to_padded_tensor(0.0))
        except RuntimeError:
            raised += 1
        if detctx.locate_divergence(lambda: (_nested(torch.jagged) * 2 + 1).sin()) is not None:
            parted += 1
    return raised, parted


def outside_data(trials: int) -> int:
    """Runs whose results differ (NumPy data, only cloned) reported as agreeing."""
    missed = 0
    for _ in range(trials):
        found = detctx.locate_divergence(
            lambda: torch.from_numpy(np.random.default_rng().random(4)).clone()
        )
        missed += found is None
    return missed


def leftovers(kills: int) -> dict[str, tuple[int, int]]:
    """For each way of dying: (folders left by the killed recordings, left after the next)."""
    counts = {}
    for how in ("SIGKILL", "SIGTERM", "os._exit"):
        with tempfile.TemporaryDirectory() as folder:
            env = {**os.environ, "TMPDIR": folder}
            for _ in range(kills):
                subprocess.run([sys.executable, "-c", _CHILD, how], env=env, timeout=120)
            left = len(list(Path(folder).glob("detctx-locate-*")))
            saved = tempfile.tempdir
            tempfile.tempdir = folder
            try:
                detctx.locate_divergence(lambda: torch.ones(2).sin())
            finally:
                tempfile.tempdir = saved
            counts[how] = (left, len(list(Path(folder).glob("detctx-locate-*"))))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--kills", type=int, default=5)
    args = parser.parse_args()
    raised, parted = nested_runs(args.trials)
    print(f"strided nested tensor: {raised} of {args.trials} recordings raised")
    print(f"jagged nested tensor: {parted} of {args.trials} identical pairs reported as parted")
    missed = outside_data(args.trials)
    print(f"NumPy data only cloned: {missed} of {args.trials} differing pairs reported as None")
    for how, (left, after) in leftovers(args.kills).items():
        print(
            f"{how}: {args.kills} recordings killed one after another left {left} folders, "
            f"{after} after one more recording"
        )


if __name__ == "__main__":
    main()
