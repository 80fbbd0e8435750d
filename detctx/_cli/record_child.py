"""What each Python process of a ``detctx record`` command does as it starts.

The ``sitecustomize`` that ``detctx record`` puts on ``PYTHONPATH`` calls
:func:`start_from_environment` in every Python process that inherits
``$DETCTX_RECORD_DIR``. Which of them record:

- torch's launcher (``torchrun``, ``python -m torch.distributed.run`` or
  ``torch.distributed.launch``) records nothing and keeps the recording's
  variables, which the ranks it starts inherit;
- a rank (``RANK`` and ``WORLD_SIZE`` above 1 when it starts) records
  ``rank<N>.trace``;
- any other process records ``main.trace`` if no process of the command has
  yet (:func:`detctx._compare.start_from_environment`).

Every process but the launcher then takes ``$DETCTX_RECORD_DIR``,
``$DETCTX_RECORD_RUN``, ``$DETCTX_RECORD_STEPS`` and
``$DETCTX_RECORD_PORTABLE_RANDOM`` (read as the recording starts) and the shim's entry on
``PYTHONPATH`` out of its environment, as ``detctx run --locate`` does
(:mod:`detctx._locate.child`): what it starts later (a helper script, a
DataLoader worker started with ``spawn``, another program) neither records
nor loads detctx, and a ``detctx.recording`` of its own does not claim this
run's identity. A process that would not record decides so before importing
torch.

Before, a program's subprocesses all imported torch through the shim (a
``python -c 'print(1)'`` started by the recorded script took a second), and
a launcher recorded an empty ``main.trace`` while ``torchrun
--nproc-per-node 1``'s only rank then found that name taken and recorded
nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import PurePath
from typing import Final

from detctx._basics import PORTABLE_ENV, STEPS_ENV
from detctx._cli.record import RECORD_ENV, RUN_ENV, SITE_FOLDER

__all__ = ["forget_recording", "is_torch_launcher", "start_from_environment"]

_LAUNCHER_MODULES: Final = frozenset({"torch.distributed.run", "torch.distributed.launch"})
_OPTIONS_WITH_VALUE: Final = frozenset({"-W", "-X", "--check-hash-based-pycs"})


def is_torch_launcher(argv: Sequence[str]) -> bool:
    """Whether the command line ``argv`` (``sys.orig_argv``: the interpreter first) starts
    torch's launcher, whose ranks record rather than itself."""
    words = iter(argv[1:])
    for word in words:
        if word == "-m":
            return next(words, "") in _LAUNCHER_MODULES
        if word.startswith("-m"):
            return word[2:] in _LAUNCHER_MODULES
        if word in ("-c", "-") or word.startswith("-c"):
            return False
        if word in _OPTIONS_WITH_VALUE:
            next(words, None)
        elif not word.startswith("-"):
            return PurePath(word).stem == "torchrun"
    return False


def _is_rank(env: MutableMapping[str, str]) -> tuple[int, int] | None:
    """The rank and world size torchrun gave this process, or ``None`` outside a world of
    several ranks (as :func:`detctx._compare.environment.rank_and_world` reads them)."""
    try:
        rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    return (rank, world) if 0 <= rank < world and world > 1 else None


def forget_recording(env: MutableMapping[str, str]) -> None:
    """Take ``$DETCTX_RECORD_DIR``, ``$DETCTX_RECORD_RUN``, ``$DETCTX_RECORD_STEPS``,
    ``$DETCTX_RECORD_PORTABLE_RANDOM`` and the shim's entry on ``PYTHONPATH`` out of ``env``
    (``PYTHONPATH`` removed when nothing else was on it)."""
    env.pop(RUN_ENV, None)
    env.pop(STEPS_ENV, None)
    env.pop(PORTABLE_ENV, None)
    folder = env.pop(RECORD_ENV, None)
    if not folder or "PYTHONPATH" not in env:
        return
    site = os.path.join(folder, SITE_FOLDER)
    rest = [entry for entry in env["PYTHONPATH"].split(os.pathsep) if entry != site]
    if any(rest):
        env["PYTHONPATH"] = os.pathsep.join(rest)
    else:
        del env["PYTHONPATH"]


def start_from_environment() -> bool:
    """Start recording this process as the module says, if it is one that records; whether
    it started. Called from the shim, with ``$DETCTX_RECORD_DIR`` set."""
    if is_torch_launcher(sys.orig_argv):
        return False
    folder = os.environ.get(RECORD_ENV, "")
    ranked = _is_rank(os.environ)
    name = f"rank{ranked[0]}.trace" if ranked else "main.trace"
    try:
        if not folder or os.path.lexists(os.path.join(folder, name)):
            return False  # not this process's to record: torch is not imported for it
        from detctx._compare import start_from_environment as start

        return start()
    finally:
        forget_recording(os.environ)
