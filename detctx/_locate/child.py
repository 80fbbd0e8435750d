"""Record the ops of a whole process when ``detctx run --locate`` asks for it.

``detctx run --locate`` starts each run with ``$DETCTX_LOCATE_TRACE`` naming
a trace file and a ``sitecustomize`` on ``PYTHONPATH`` that calls
:func:`start_from_environment` when Python starts, so ``python train.py``
records without a change to ``train.py``. The variable is removed from the
environment at once, so processes the run starts later (a second script) do not record over
the same file; a forked child (a DataLoader worker) stops recording in
itself (:mod:`detctx._locate.recorder`). The trace is closed at interpreter exit.

Every run of one ``detctx run --locate`` digests under one secret key, handed
over in ``$DETCTX_LOCATE_KEY`` (:mod:`detctx._locate.keys`) and removed from
the environment before the program runs, like the trace's variable. A run
without a well-formed key is not recorded: its digests could not be compared.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Final, Protocol

from detctx._basics import TraceError
from detctx._locate.keys import KEY_ENV, use_key
from detctx._locate.recorder import OpRecorder
from detctx._locate.trace import TraceWriter

__all__ = ["TRACE_ENV", "record_until_exit", "start_from_environment"]

TRACE_ENV: Final = "DETCTX_LOCATE_TRACE"


def _check_path(value: str) -> Path | str:
    path = Path(value)
    if not path.is_absolute():
        return "it is not an absolute path"
    if not path.parent.is_dir():
        return f"its folder {path.parent} does not exist"
    if path.exists():
        return "the file exists already (another process of this run records into it)"
    return path


def start_from_environment() -> bool:
    """Start recording into ``$DETCTX_LOCATE_TRACE`` if it is set; whether it started.

    A value that is not an absolute path to a new file in an existing folder
    is reported on stderr and ignored: the program runs unrecorded and
    ``detctx run --locate`` reports the missing trace.
    """
    value = os.environ.pop(TRACE_ENV, None)
    key = os.environ.pop(KEY_ENV, None)
    if not value:
        return False
    checked = _check_path(value)
    if isinstance(checked, str):
        sys.stderr.write(f"detctx: not recording ops: ${TRACE_ENV}={value!r}: {checked}\n")
        return False
    try:
        use_key(key or "")
    except TraceError as exc:
        sys.stderr.write(f"detctx: not recording ops: {exc}\n")
        return False
    try:
        writer = TraceWriter(checked, exclusive=True)
    except OSError as exc:
        sys.stderr.write(f"detctx: not recording ops into {checked}: {exc.strerror or exc}\n")
        return False
    record_until_exit(OpRecorder(writer), writer)
    return True


class _Recorder(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


class _Writer(Protocol):
    def close(self) -> None: ...


def record_until_exit(recorder: _Recorder, writer: _Writer) -> None:
    """Start ``recorder`` and stop it, then close ``writer``, when this process exits: not
    in a child forked from it, whose exit would close the parent's trace."""
    recorder.start()
    pid = os.getpid()

    def finish() -> None:
        if os.getpid() == pid:
            recorder.stop()
            writer.close()

    atexit.register(finish)
