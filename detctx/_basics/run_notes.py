"""What a run tells ``detctx run`` about its first block: the seed, where the seed came from,
and which global generators had drawn before it; one JSON line, written and read here.

``detctx run`` names a file per run in ``$DETCTX_RUN_NOTES``. The first time a
process enters a ``deterministic`` block (or calls ``seed_all``) it appends a line
there; the parent reads the first line of each file after the run, as untrusted
input, to tell the user what only the run could see: that its seed came from the
``DETCTX_SEED`` that ``detctx run`` exported (so a plain ``python train.py`` draws
a fresh one), or that the block was entered after draws that differed from run to
run. A process that never enters a block writes nothing, which says as much.
Nothing here imports torch or NumPy: their states are read only when the user's
program already imported them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from detctx._basics.seeds import MAX_SEED, SEED_ENV

__all__ = ["NOTES_ENV", "EntryNote", "note_entry", "read_entry_note"]

NOTES_ENV: Final = "DETCTX_RUN_NOTES"
"""The file a run notes its first block in (set by ``detctx run``)."""

SEED_FROM: Final = ("argument", "environment", "fresh")
"""Where a block's seed came from: its own argument, ``$DETCTX_SEED``, OS entropy."""

BLOCKS: Final = ("deterministic", "distributed_deterministic")
"""Which kind of block noted its seed (``seed_all`` seeds through a ``deterministic`` block)."""

STREAMS: Final = ("random", "numpy", "torch")
"""The global generators whose draws before the first block are noted."""

_MAX_READ: Final = 65536
"""Bytes of a notes file read back: a note is about 200."""

_noted_in: int | None = None
"""The process that wrote its note (a forked child writes its own)."""


@dataclass(frozen=True)
class EntryNote:
    """A run's first block: its ``seed``, where it came from (one of :data:`SEED_FROM`), and
    for each global generator that had drawn since it was seeded a digest of its state."""

    seed: int
    seed_from: str
    drawn: dict[str, str]
    block: str = "deterministic"


def note_entry(seed: int, *, given: bool, block: str = "deterministic") -> None:
    """Note the first block of this process in ``$NOTES_ENV``, when ``detctx run`` set it.

    ``given``: the block was given its seed; ``block``: one of :data:`BLOCKS`. Never
    raises: a note that cannot be written only leaves ``detctx run`` with less to say.
    """
    global _noted_in
    path = os.environ.get(NOTES_ENV)
    if not path or _noted_in == os.getpid():
        return
    _noted_in = os.getpid()
    from_env = os.environ.get(SEED_ENV, "").strip() != ""
    seed_from = "argument" if given else ("environment" if from_env else "fresh")
    try:
        drawn = _drawn()
    except Exception:  # a generator replaced by something odd: the note goes without it
        drawn = {}
    note = {"seed": seed, "seed_from": seed_from, "drawn": drawn, "block": block}
    line = json.dumps(note) + "\n"
    try:
        # The parent made the file: never create one, nor follow a link planted there.
        flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
        descriptor = os.open(path, flags)
        try:
            os.write(descriptor, line.encode())
        finally:
            os.close(descriptor)
    except OSError:
        pass


def _drawn() -> dict[str, str]:
    """A digest of each global generator's state that moved since it was last seeded."""
    drawn = {}
    random = sys.modules.get("random")
    if random is not None:
        _, words, _ = random.getstate()
        if words[-1] != 624:  # the position in the state words: 624 right after seeding
            drawn["random"] = _digest(repr(words).encode())
    np = sys.modules.get("numpy")
    if np is not None and hasattr(np, "random"):
        _, keys, position, has_gauss, _ = np.random.get_state()
        # 624 after np.random.seed(s), 623 after seeding from entropy (a SeedSequence)
        if position not in (623, 624) or has_gauss:
            drawn["numpy"] = _digest(keys.tobytes() + repr((position, has_gauss)).encode())
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "default_generator"):
        state = torch.default_generator.get_state()
        fresh = torch.Generator().manual_seed(torch.default_generator.initial_seed())
        if not torch.equal(state, fresh.get_state()):
            drawn["torch"] = _digest(bytes(state.tolist()))
    return drawn


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def read_entry_note(path: Path) -> EntryNote | None:
    """The first well-formed note in ``path``, or ``None`` (no block entered, or nothing
    that reads as a note: the file is untrusted, and a line that is not exactly a note's
    shape is skipped)."""
    try:
        with open(path, "rb") as notes:
            text = notes.read(_MAX_READ).decode("utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        note = _parse(line)
        if note is not None:
            return note
    return None


def _parse(line: str) -> EntryNote | None:
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    keys = {"seed", "seed_from", "drawn"}
    if not isinstance(data, dict) or set(data) not in (keys, keys | {"block"}):
        return None
    seed, seed_from, drawn = data["seed"], data["seed_from"], data["drawn"]
    block = data.get("block", BLOCKS[0])
    if block not in BLOCKS:
        return None
    if type(seed) is not int or not 0 <= seed <= MAX_SEED or seed_from not in SEED_FROM:
        return None
    if not isinstance(drawn, dict) or not set(drawn) <= set(STREAMS):
        return None
    if not all(isinstance(v, str) and len(v) == 16 and _is_hex(v) for v in drawn.values()):
        return None
    return EntryNote(seed, seed_from, dict(drawn), block)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)
