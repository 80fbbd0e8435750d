"""One verdict for every rank: either all go ahead, or all raise the same refusal.

A resume (:func:`detctx.resume`, a DCP load of :func:`detctx.dcp_resume_state`)
is checked on each rank against that rank's own state and loaders; a refusal
on one rank alone left the others resumed and waiting at their next
collective. :func:`decide_together` gathers each rank's outcome in one small
``all_gather`` (bounded by ``timeout``, :mod:`detctx.distributed._arrival`):
``[refused, length of its reason, key]``. Where no rank refused and the keys
agree it returns on every rank; otherwise every rank raises the same error,
naming each rank that refused and why (their reasons come in a second gather,
only then). ``key`` is what the ranks must share (the run their states were
saved in: 0 for none).
"""

from __future__ import annotations

import secrets
from typing import Any, Final

from detctx._basics import CheckpointError
from detctx.distributed._arrival import (
    DEFAULT_TIMEOUT_S,
    default_store,
    gather_rows,
    ranks_by_label,
    ranks_text,
)
from detctx.distributed._topology import in_process_group, rank_and_size

__all__ = ["decide_together", "run_identity"]

_MAX_REASON_BYTES: Final = 4000
_WORD: Final = 8
_RUN_KEY: Final = "detctx/run"
_own_run: Final = secrets.token_hex(8)


def run_identity() -> str:
    """An id shared by every process of this launch: the first process of the default group to
    ask puts a fresh one in the group's store and every other one reads it there
    (``compare_set``: no process waits for another); outside a process group, or where the store
    cannot be reached, this process's own."""
    if not in_process_group():
        return _own_run
    store = default_store()
    if store is None:
        return f"process-{_own_run}"
    try:
        # Asked each time (one round trip): a group made again on another store is another run.
        return bytes(store.compare_set(_RUN_KEY, "", secrets.token_hex(8))).decode()
    except (RuntimeError, ValueError, UnicodeDecodeError):
        return f"process-{_own_run}"


def decide_together(
    refusal: BaseException | None,
    *,
    what: str,
    key: int = 0,
    group: Any = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Return on every rank of ``group`` if no rank refused ``what``; else raise on every rank.

    ``refusal`` is this rank's exception (``None``: it goes ahead). Outside a
    process group, or in a group of one, ``refusal`` itself is raised. In a
    group every rank raises the same :class:`~detctx.CheckpointError`
    (``from`` its own exception where it refused); a rank that does not
    arrive within ``timeout`` seconds gives :class:`~detctx.SeedAgreementError`
    on the ranks that wait. ``key``: an int64 every rank must send alike (0 is
    left out of the comparison).
    """
    if not in_process_group():
        _raise_alone(refusal)
        return
    rank, world_size = rank_and_size(group)
    if world_size == 1:
        _raise_alone(refusal)
        return
    reason = b"" if refusal is None else _reason(refusal)
    rows = gather_rows(
        [int(refusal is not None), len(reason), key], group, rank, world_size, timeout, what
    )
    keys = {row[2] for row in rows if row[2] != 0}
    if not any(row[0] for row in rows) and len(keys) <= 1:
        return
    if any(row[0] for row in rows):
        width = -(-max(row[1] for row in rows) // _WORD)
        words = _words(reason, width)
        texts = gather_rows(words, group, rank, world_size, timeout, what)
        reasons = {
            other: _text(texts[other], rows[other][1])
            for other in range(world_size)
            if rows[other][0]
        }
        message = _refused_message(what, reasons)
    else:
        message = _mixed_message(what, {other: row[2] for other, row in enumerate(rows)})
    raise CheckpointError(message) from refusal


def _raise_alone(refusal: BaseException | None) -> None:
    if refusal is not None:
        raise refusal


def _reason(refusal: BaseException) -> bytes:
    text = str(refusal) or type(refusal).__name__
    if not isinstance(refusal, CheckpointError):
        text = f"{type(refusal).__name__}: {text}"
    data = text.encode("utf-8", "replace")
    if len(data) > _MAX_REASON_BYTES:
        data = data[: _MAX_REASON_BYTES - 3].decode("utf-8", "ignore").encode() + b"..."
    return data


def _words(data: bytes, width: int) -> list[int]:
    padded = data.ljust(width * _WORD, b"\0")
    return [
        int.from_bytes(padded[i : i + _WORD], "little", signed=True)
        for i in range(0, len(padded), _WORD)
    ]


def _text(words: list[int], length: int) -> str:
    data = b"".join(word.to_bytes(_WORD, "little", signed=True) for word in words)
    return data[:length].decode("utf-8", "replace")


def _refused_message(what: str, reasons: dict[int, str]) -> str:
    by_reason = ranks_by_label(reasons)
    refused = ranks_text(sorted(reasons))
    parts = [f"{ranks_text(ranks)}: {reason}" for reason, ranks in by_reason.items()]
    return (
        f"{what} was refused on {refused}, so on every rank, with nothing of detctx "
        f"changed on any rank (the RNGs and loaders as before). " + " | ".join(parts)
    )


def _mixed_message(what: str, keys: dict[int, int]) -> str:
    labels = {rank: f"run #{key & 0xFFFFFFFF:08x}" for rank, key in keys.items() if key != 0}
    by_run = ranks_by_label(labels)
    runs = "; ".join(f"{label} on {ranks_text(ranks)}" for label, ranks in by_run.items())
    return (
        f"{what} was refused on every rank, with nothing of detctx changed: the ranks hold "
        f"states saved by different runs ({runs}). Resume every rank from one checkpoint, "
        "the one saved together by the same run."
    )
