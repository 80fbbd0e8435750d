"""What a training log says about the environment it ran in, and how two logs' differ.

Frameworks and scripts print a few lines about their environment: ``torch
2.1.2`` or ``PyTorch version: 2.13.0+cpu`` (a script's own print, Megatron's
and MindSpeed's argument dumps, ``python -m torch.utils.collect_env``),
Lightning's ``GPU available: True (cuda), used: True``, torchtitan's ``CUDA
capacity: NVIDIA H100 80GB HBM3 with 79.11GiB memory``. Only such labelled
lines are read: a version is a library's name followed by a dotted number, a
device is what those two frameworks print. A log that prints none shows no
environment, which says nothing about whether two logs share one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

__all__ = ["environment_differences", "environment_of"]

_LIBRARIES: Final = (
    "torch",
    "pytorch",
    "torch_npu",
    "cuda",
    "cudnn",
    "nccl",
    "hccl",
    "cann",
    "rocm",
    "triton",
    "python",
    "numpy",
    "transformers",
    "lightning",
)

_VERSION: Final = re.compile(
    r"(?i)(?<![\w./-])(?P<name>" + "|".join(_LIBRARIES) + r")(?:[ _]version)?"
    r"['\"]?(?:\s*(?:==|[:=])\s*|\s+)v?(?P<value>\d+(?:\.\d+)+[\w.+-]*)"
)
"""``torch 2.1.2``, ``torch==2.1.2``, ``PyTorch version: 2.13.0+cpu``, ``CUDA version 12.1``.
One separator group, as in :data:`~detctx._cli.curves.DEFAULT_PATTERN`: ``\\s*`` before
``\\s+`` backtracked over every split of a run of spaces."""

_LIGHTNING_GPU: Final = re.compile(r"\bGPU available: (?P<value>\w+(?: \(\w+\))?)")
_TITAN_DEVICE: Final = re.compile(r"\b(?:CUDA|NPU|XPU|MPS|ROCM) capacity: (?P<value>.+?) with ")
_TITAN_PREFIX: Final = "[titan] "
"""How torchtitan's logger starts each line (``torchtitan/tools/logging.py``)."""

_READ_LINES: Final = 10_000
"""Lines of a log searched: environment lines come at its start, and a log of a
million lines would otherwise be searched three more times."""


def environment_of(lines: Iterable[str]) -> dict[str, str]:
    """The environment a log's lines name: ``{"torch": "2.1.2", "device": "NVIDIA A100"}``,
    the first value of each name in its first :data:`_READ_LINES` lines; ``"framework":
    "torchtitan"`` for a torchtitan log."""
    found: dict[str, str] = {}
    for number, line in enumerate(lines):
        if number >= _READ_LINES:
            break
        for match in _VERSION.finditer(line):
            name = match.group("name").lower()
            found.setdefault("torch" if name == "pytorch" else name, match.group("value"))
        gpu = _LIGHTNING_GPU.search(line)
        if gpu is not None:
            found.setdefault("GPU available", gpu.group("value"))
        device = _TITAN_DEVICE.search(line)
        if device is not None:
            found.setdefault("device", device.group("value").strip())
        if line.startswith(_TITAN_PREFIX):
            found.setdefault("framework", "torchtitan")
    return found


def environment_differences(
    names: Sequence[str], environments: Sequence[Mapping[str, str]]
) -> list[str]:
    """What the logs ``names`` show differently, one text per name that two of them give
    different values: ``"torch 2.1.2 in a.log, 2.13.0+cpu in b.log"``. A name one log
    does not print is no difference: it says nothing."""
    shown = list(dict.fromkeys(key for environment in environments for key in environment))
    differences = []
    for key in shown:
        values = [(name, env[key]) for name, env in zip(names, environments) if key in env]
        if len({value for _, value in values}) < 2:
            continue
        first_name, first_value = values[0]
        rest = ", ".join(f"{_short(value)} in {name}" for name, value in values[1:])
        differences.append(f"{key} {_short(first_value)} in {first_name}, {rest}")
    return differences


def _short(value: str) -> str:
    return value if len(value) <= 60 and value.isprintable() else repr(value[:60])
