"""Run a group of the docs' Python examples in one process, each as if in a fresh one.

Started by ``test_doc_examples.py`` as ``python doc_example_runner.py SPEC OUT``
(under ``torchrun`` for the distributed examples): SPEC is a JSON list of
``{"name", "code", "preamble"}``. Each example runs in its own namespace
(after ``examples/docs_preamble.py`` when ``preamble`` is true), with Python's,
NumPy's and torch's RNGs drawn afresh from OS entropy as at a process's start,
and with the environment, determinism flags and registered RNG sources put
back after it. What each
one printed, or the traceback it raised, goes to ``OUT`` (``OUT.rank<r>`` under
torchrun) as JSON.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

import detctx
from detctx._sources.registry import registered_sources

ROOT = Path(__file__).resolve().parent.parent
PREAMBLE = ROOT / "examples" / "docs_preamble.py"


def fresh_process_state() -> None:
    """What a new process starts with: every RNG from OS entropy, determinism off."""
    random.seed()
    np.random.seed()
    torch.seed()
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = False


def run_one(example: dict[str, object]) -> dict[str, object]:
    saved_env = dict(os.environ)
    sources = {name for name, _ in registered_sources()}
    started = time.perf_counter()
    fresh_process_state()
    namespace: dict[str, object] = {"__name__": "__main__"}
    printed = io.StringIO()
    error = None
    try:
        with contextlib.redirect_stdout(printed):
            if example["preamble"]:
                exec(compile(PREAMBLE.read_text(), str(PREAMBLE), "exec"), namespace)
            exec(compile(str(example["code"]), str(example["name"]), "exec"), namespace)
    except BaseException:
        error = traceback.format_exc()
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)
        for name in [name for name, _ in registered_sources() if name not in sources]:
            detctx.unregister_source(name)
    seconds = time.perf_counter() - started
    return {"name": example["name"], "stdout": printed.getvalue(), "error": error, "s": seconds}


def main() -> None:
    spec, out = sys.argv[1], sys.argv[2]
    examples = json.loads(Path(spec).read_text())
    results = [run_one(example) for example in examples]
    if "RANK" in os.environ:
        out = f"{out}.rank{os.environ['RANK']}"
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
