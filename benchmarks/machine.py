"""What the benchmarks ran on."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import torch

import detctx


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _usable_cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _lightning_version() -> str:
    for name in ("lightning", "pytorch_lightning"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        return f"{name} {getattr(module, '__version__', '?')}"
    return "not installed"


def describe() -> dict[str, str]:
    return {
        "CPU": _cpu_model(),
        "cores usable": str(_usable_cores()),
        "OS": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "detctx": f"{detctx.__version__} ({_commit()})",
        "lightning": _lightning_version(),
        "accelerators": ", ".join(sorted(_accelerators())) or "none",
    }


def _accelerators() -> list[str]:
    found = []
    if torch.cuda.is_available():
        found.append(f"cuda x{torch.cuda.device_count()} ({torch.cuda.get_device_name(0)})")
    return found
