"""RNG states to and from plain data, for checkpoints.

``Snapshot.state_dict()`` turns every captured state into tensors, ints,
floats, strings, ``None``, lists and dicts, so that ``torch.save`` followed by
``torch.load(..., weights_only=True)`` brings it back with no pickled NumPy
objects and no allow-list. Each source converts its own state:

- a built-in source (Python, NumPy, torch CPU, each accelerator) knows its
  checkpoint form (:class:`~detctx._sources.registry.Checkpointable`): the kinds it
  writes and reads, and the checks of every value it reads back;
- ``custom``: a user source with ``state_to_plain(state)`` and
  ``state_from_plain(plain)`` methods converts its own state;
- ``plain``: any other user source whose captured state is already plain
  data is stored as it is.

The dict carries a format name and version and, from version 2, a digest of
the rest: a state that fits its source but is not the one saved (a flipped
bit of a Mersenne Twister word, a NumPy position one off) passes every check
of its shape, and only the digest tells. Reading a dict of a newer version,
one whose sources do not match this process's, or one whose digest does not
match what it holds raises :class:`~detctx.CheckpointError` before any RNG
is touched. Version 1 dicts (written by a detctx before the digest) carry
none and are read with the checks of their shape only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Protocol, runtime_checkable

from detctx._basics import CheckpointError, open_envelope, plain_digest, same_plain
from detctx._sources import Checkpointable, RNGSource, checks, plain

__all__ = [
    "FORMAT",
    "VERSION",
    "PlainStateSource",
    "decode",
    "encode",
]

FORMAT: Final = "detctx.RNGState"
"""The ``"format"`` entry of every RNG state dict."""

VERSION: Final = 2
"""The layout version this detctx writes (2: with a digest), and the newest it reads."""
_KEYS: Final = frozenset({"format", "version", "sources", "digest"})

@runtime_checkable
class PlainStateSource(Protocol):
    """An RNG source that converts its own captured state for checkpoints.

    ``state_to_plain(state)`` returns tensors, ints, floats, strings, ``None``,
    lists, tuples and dicts with string keys; ``state_from_plain(plain)`` turns
    that back into a state ``restore`` accepts. Sources whose ``capture()``
    already returns such data need neither method.
    """

    def state_to_plain(self, state: Any) -> Any: ...

    def state_from_plain(self, plain: Any) -> Any: ...


def encode(captured: list[tuple[str, RNGSource, Any]]) -> dict[str, Any]:
    """The state dict of ``(name, source, captured state)`` triples."""
    entries: dict[str, Any] = {}
    for name, source, state in captured:
        kind, stored = _form(name, source).to_checkpoint(state)
        entries[name] = {"kind": kind, "state": stored}
    state = {"format": FORMAT, "version": VERSION, "sources": entries}
    state["digest"] = plain_digest(state)
    return state


def decode(
    state_dict: object, sources: list[tuple[str, RNGSource]], *, strict: bool = True
) -> list[tuple[str, RNGSource, Any]]:
    """The ``(name, source, state)`` triples a state dict holds, matched to ``sources``.

    Raises :class:`CheckpointError` for a dict of another format or version,
    a saved source that is not registered here, a state that does not fit its
    source and, with ``strict``, a source managed here that the dict lacks.
    """
    state_dict = _check_header(state_dict)
    entries = state_dict["sources"]
    by_name = dict(sources)
    if strict:
        missing = [name for name in by_name if name not in entries]
        if missing:
            raise CheckpointError(
                f"the RNG state dict has no state for source(s) {', '.join(map(repr, missing))}, "
                "which this process manages (saved where they did not exist?); pass "
                "strict=False to leave them as they are"
            )
    decoded: list[tuple[str, RNGSource, Any]] = []
    for name, entry in entries.items():
        source = by_name.get(name)
        if source is None:
            if not strict:
                continue
            raise CheckpointError(
                f"the RNG state dict has a state for source {name!r}, which is not registered "
                f"in this process: call detctx.register_source({name!r}, ...) before restoring, "
                "or pass strict=False to skip it"
            )
        if not isinstance(entry, Mapping) or not isinstance(entry.get("kind"), str):
            raise CheckpointError(f"the RNG state dict's entry for {name!r} is malformed")
        decoded.append((name, source, _decode_one(name, source, entry["kind"], entry.get("state"))))
    # Last, so that a state a check above refuses is told what differs.
    _check_digest(state_dict)
    return decoded


def _check_header(state_dict: object) -> Mapping[str, Any]:
    """``state_dict`` once its envelope and keys are what its version holds."""
    state_dict = open_envelope(
        state_dict,
        FORMAT,
        VERSION,
        what="the RNG state dict",
        refusal="not a detctx RNG state dict",
        hint="pass the dict returned by detctx.capture().state_dict()",
    )
    entries = state_dict.get("sources")
    if not isinstance(entries, Mapping):
        raise CheckpointError("the RNG state dict has no 'sources' mapping")
    keys = _KEYS if state_dict["version"] >= 2 else _KEYS - {"digest"}
    if set(state_dict) != keys:
        raise CheckpointError(
            f"the RNG state dict of version {state_dict['version']} holds keys "
            f"{sorted(map(str, state_dict))}; that version holds {sorted(keys)}: a corrupted "
            "or edited checkpoint"
        )
    return state_dict


def _check_digest(state_dict: Mapping[str, Any]) -> None:
    if state_dict["version"] < 2:
        return  # written before the digest: nothing to check it against
    rest = {key: value for key, value in state_dict.items() if key != "digest"}
    if not same_plain(state_dict["digest"], plain_digest(rest)):
        raise CheckpointError(
            "the RNG state dict was changed after it was saved (its digest does not match the "
            "states it holds): a corrupted or edited checkpoint; restore from another one"
        )


def _decode_one(name: str, source: RNGSource, kind: str, stored: Any) -> Any:
    form = _form(name, source)
    if kind not in form.checkpoint_kinds:
        raise CheckpointError(
            f"the RNG state dict holds a {kind!r} state for source {name!r}, but the source "
            f"registered as {name!r} here is a {type(source).__name__}, which takes "
            f"{' or '.join(map(repr, sorted(form.checkpoint_kinds)))}: register the same kind "
            "of RNG under that name before restoring"
        )
    try:
        state = form.from_checkpoint(kind, stored)
        validate = getattr(source, "validate_state", None)
        if validate is not None:
            validate(state)
        return state
    except CheckpointError:
        raise
    except checks.InvalidField as exc:
        raise CheckpointError(
            f"the RNG state dict's {kind!r} state for source {name!r} has an invalid "
            f"{exc.field}: {exc.reason}; nothing was restored (a corrupted or crafted checkpoint?)"
        ) from exc
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(
            f"the RNG state dict's {kind!r} state for source {name!r} is malformed "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _form(name: str, source: RNGSource) -> Checkpointable:
    """How ``source``'s state goes to and from a checkpoint: its own form, or a user's."""
    if isinstance(source, PlainStateSource):
        return _Converted(name, source)
    if isinstance(source, Checkpointable):
        return source
    return _AsIs(name)


class _Converted:
    """A user source that converts its own state (``state_to_plain`` / ``state_from_plain``)."""

    checkpoint_kinds: Final = frozenset({"custom"})

    def __init__(self, name: str, source: PlainStateSource) -> None:
        self._name = name
        self._source = source

    def to_checkpoint(self, state: Any) -> tuple[str, Any]:
        stored = self._source.state_to_plain(state)
        _require_plain(self._name, stored, "its state_to_plain() result")
        return "custom", stored

    def from_checkpoint(self, kind: str, stored: Any) -> Any:
        return self._source.state_from_plain(stored)


class _AsIs:
    """A user source whose captured state is plain data already."""

    checkpoint_kinds: Final = frozenset({"plain"})

    def __init__(self, name: str) -> None:
        self._name = name

    def to_checkpoint(self, state: Any) -> tuple[str, Any]:
        _require_plain(self._name, state, "its captured state")
        return "plain", state

    def from_checkpoint(self, kind: str, stored: Any) -> Any:
        return stored


def _require_plain(name: str, value: Any, what: str) -> None:
    problem = plain.problem(value)
    if problem is not None:
        raise CheckpointError(
            f"cannot store source {name!r} in a state dict: {what} holds {problem}. Give the "
            "source state_to_plain(state) and state_from_plain(plain) methods that convert "
            "it to tensors, numbers, strings, lists and dicts"
        )
