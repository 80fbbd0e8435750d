"""RNG states to and from plain data, for checkpoints.

``Snapshot.state_dict()`` turns every captured state into tensors, ints,
floats, strings, ``None``, lists and dicts, so that ``torch.save`` followed by
``torch.load(..., weights_only=True)`` brings it back with no pickled NumPy
objects and no allow-list. Each source kind has its own conversion:

- ``python`` (``random.Random``): the 625-word Mersenne Twister state as an
  int64 tensor, plus the version and the cached Gaussian.
- ``numpy-legacy`` (``RandomState``): the 624 key words as an int64 tensor,
  plus position and cached Gaussian.
- ``numpy-bitgen`` (a ``Generator``'s bit generator, or a ``RandomState``
  built on a bit generator other than MT19937): the state dict, with each
  array stored as its raw bytes and dtype.
- ``torch``: the generator's state tensor.
- ``accelerator``: one state tensor per device; ``accelerator-uninitialised``:
  the seed that was pending for a device type the program had not used (the
  lazy queue it was read from belongs to the process, so restoring re-queues
  the seed instead of rewinding a queue).
- ``custom``: a user source with ``state_to_plain(state)`` and
  ``state_from_plain(plain)`` methods converts its own state.
- ``plain``: any other user source whose captured state is already plain
  data is stored as it is.

The dict carries a format name and version; reading a dict of another
version, or one whose sources do not match this process's, raises
:class:`~detctx.CheckpointError` before any RNG is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Protocol, runtime_checkable

import numpy as np
import torch

from detctx import _state_checks as state_checks
from detctx._accelerators import AcceleratorSource, Uninitialised
from detctx._errors import CheckpointError
from detctx._sources import (
    NumpyGeneratorSource,
    NumpyRandomStateSource,
    PythonRandomSource,
    RNGSource,
    TorchGeneratorSource,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "PlainStateSource",
    "decode",
    "encode",
]

FORMAT: Final = "detctx.RNGState"
"""The ``"format"`` entry of every RNG state dict."""

VERSION: Final = 1
"""The layout version this detctx writes and reads."""

_ARRAY_TAG: Final = "__ndarray__"


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
        kind, plain = _encode_one(name, source, state)
        entries[name] = {"kind": kind, "state": plain}
    return {"format": FORMAT, "version": VERSION, "sources": entries}


def decode(
    state_dict: object, sources: list[tuple[str, RNGSource]], *, strict: bool = True
) -> list[tuple[str, RNGSource, Any]]:
    """The ``(name, source, state)`` triples a state dict holds, matched to ``sources``.

    Raises :class:`CheckpointError` for a dict of another format or version,
    a saved source that is not registered here, a state that does not fit its
    source and, with ``strict``, a source managed here that the dict lacks.
    """
    entries = _check_header(state_dict)
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
    return decoded


def _check_header(state_dict: object) -> Mapping[str, Any]:
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != FORMAT:
        raise CheckpointError(
            f"not a detctx RNG state dict (no 'format': {FORMAT!r} entry); pass the dict "
            "returned by detctx.capture().state_dict()"
        )
    version = state_dict.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"the RNG state dict has an invalid format version {version!r}")
    if version > VERSION:
        raise CheckpointError(
            f"the RNG state dict was written by a newer detctx (format version {version}); "
            f"this detctx reads version {VERSION}: upgrade detctx to restore it"
        )
    entries = state_dict.get("sources")
    if not isinstance(entries, Mapping):
        raise CheckpointError("the RNG state dict has no 'sources' mapping")
    return entries


def _encode_one(name: str, source: RNGSource, state: Any) -> tuple[str, Any]:
    if isinstance(source, PlainStateSource):
        plain = source.state_to_plain(state)
        _require_plain(name, plain, "its state_to_plain() result")
        return "custom", plain
    if isinstance(source, PythonRandomSource):
        version, internal, gauss_next = state
        return "python", {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        }
    if isinstance(source, NumpyRandomStateSource) and isinstance(state, tuple):
        bit_generator, key, pos, has_gauss, cached_gaussian = state
        return "numpy-legacy", {
            "bit_generator": str(bit_generator),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    if isinstance(source, (NumpyRandomStateSource, NumpyGeneratorSource)):
        return "numpy-bitgen", _numpy_to_plain(state)
    if isinstance(source, TorchGeneratorSource):
        return "torch", state.clone()
    if isinstance(source, AcceleratorSource):
        if isinstance(state, Uninitialised):
            return "accelerator-uninitialised", {"seed_before": int(state.seed_before)}
        return "accelerator", {"devices": [device_state.clone() for device_state in state]}
    _require_plain(name, state, "its captured state")
    return "plain", state


def _decode_one(name: str, source: RNGSource, kind: str, plain: Any) -> Any:
    expected = _kinds_for(source)
    if kind not in expected:
        raise CheckpointError(
            f"the RNG state dict holds a {kind!r} state for source {name!r}, but the source "
            f"registered as {name!r} here is a {type(source).__name__}, which takes "
            f"{' or '.join(map(repr, sorted(expected)))}: register the same kind of RNG under "
            "that name before restoring"
        )
    try:
        state = _DECODERS[kind](source, plain)
        validate = getattr(source, "validate_state", None)
        if validate is not None:
            validate(state)
        return state
    except CheckpointError:
        raise
    except state_checks.InvalidField as exc:
        raise CheckpointError(
            f"the RNG state dict's {kind!r} state for source {name!r} has an invalid "
            f"{exc.field}: {exc.reason}; nothing was restored (a corrupted or crafted checkpoint?)"
        ) from exc
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(
            f"the RNG state dict's {kind!r} state for source {name!r} is malformed "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _kinds_for(source: RNGSource) -> set[str]:
    if isinstance(source, PlainStateSource):
        return {"custom"}
    if isinstance(source, PythonRandomSource):
        return {"python"}
    if isinstance(source, NumpyRandomStateSource):
        return {"numpy-legacy", "numpy-bitgen"}
    if isinstance(source, NumpyGeneratorSource):
        return {"numpy-bitgen"}
    if isinstance(source, TorchGeneratorSource):
        return {"torch"}
    if isinstance(source, AcceleratorSource):
        return {"accelerator", "accelerator-uninitialised"}
    return {"plain"}


def _decode_python(source: RNGSource, plain: Any) -> Any:
    internal = _tensor(plain["internal"], torch.int64).numpy()
    state_checks.check_python(plain["version"], internal, plain["gauss_next"])
    return (plain["version"], tuple(int(word) for word in internal.tolist()), plain["gauss_next"])


def _decode_numpy_legacy(source: RNGSource, plain: Any) -> Any:
    assert isinstance(source, NumpyRandomStateSource)
    words = _tensor(plain["key"], torch.int64).numpy()
    state_checks.check_words(words, "key", state_checks.MT_WORDS)
    fields = (plain["bit_generator"], plain["pos"], plain["has_gauss"], plain["cached_gaussian"])
    state_checks.check_numpy_legacy(*fields)
    if not isinstance(source.bit_generator, np.random.MT19937):
        raise state_checks.InvalidField(
            "bit_generator", f"this source's is {type(source.bit_generator).__name__}"
        )
    return (fields[0], words.astype(np.uint32), *fields[1:])


def _decode_numpy_bitgen(source: RNGSource, plain: Any) -> Any:
    assert isinstance(source, (NumpyRandomStateSource, NumpyGeneratorSource))
    state = _numpy_from_plain(plain)
    state_checks.check_bit_generator(state, source.bit_generator)
    return state


def _decode_torch(source: RNGSource, plain: Any) -> Any:
    assert isinstance(source, TorchGeneratorSource)
    state = _tensor(plain, torch.uint8).clone()
    state_checks.check_torch(state, torch.Generator(device=source.device))
    return state


def _decode_accelerator(source: RNGSource, plain: Any) -> Any:
    assert isinstance(source, AcceleratorSource)
    devices = plain["devices"]
    if not isinstance(devices, list) or not devices:
        raise TypeError("devices must be a non-empty list of state tensors")
    present = source.state_count()
    if len(devices) != present:
        raise CheckpointError(
            f"the RNG state dict holds states for {len(devices)} {source.device_type} devices, "
            f"this process sees {present}: restore on the same number of devices (or make "
            "the same devices visible)"
        )
    states = tuple(_tensor(device_state, torch.uint8).clone() for device_state in devices)
    state_checks.check_accelerator(states, source.capture() if source.is_initialized() else None)
    return states


def _decode_uninitialised(source: RNGSource, plain: Any) -> Any:
    seed_before = plain["seed_before"]
    state_checks.check_pending_seed(seed_before)
    return Uninitialised(seed_before, None)


def _decode_custom(source: RNGSource, plain: Any) -> Any:
    assert isinstance(source, PlainStateSource)
    return source.state_from_plain(plain)


def _decode_plain(source: RNGSource, plain: Any) -> Any:
    return plain


_DECODERS: Final = {
    "python": _decode_python,
    "numpy-legacy": _decode_numpy_legacy,
    "numpy-bitgen": _decode_numpy_bitgen,
    "torch": _decode_torch,
    "accelerator": _decode_accelerator,
    "accelerator-uninitialised": _decode_uninitialised,
    "custom": _decode_custom,
    "plain": _decode_plain,
}


def _tensor(value: Any, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != dtype:
        raise TypeError(f"expected a {dtype} tensor, got {type(value).__name__}")
    return value


def _numpy_to_plain(value: Any) -> Any:
    """NumPy bit-generator state (nested dicts of ints and arrays) as plain data."""
    if isinstance(value, dict):
        return {str(key): _numpy_to_plain(item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        contiguous = np.ascontiguousarray(value)
        return {
            _ARRAY_TAG: contiguous.dtype.str,
            "shape": list(contiguous.shape),
            "data": torch.from_numpy(contiguous.reshape(-1).view(np.uint8).copy()),
        }
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def _numpy_from_plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        if _ARRAY_TAG in value:
            data = _tensor(value["data"], torch.uint8).numpy().tobytes()
            array = np.frombuffer(data, dtype=np.dtype(value[_ARRAY_TAG]))
            return array.reshape(tuple(value["shape"])).copy()
        return {key: _numpy_from_plain(item) for key, item in value.items()}
    return value


def _require_plain(name: str, value: Any, what: str) -> None:
    problem = _plain_problem(value, "state")
    if problem is not None:
        raise CheckpointError(
            f"cannot store source {name!r} in a state dict: {what} holds {problem}. Give the "
            "source state_to_plain(state) and state_from_plain(plain) methods that convert "
            "it to tensors, numbers, strings, lists and dicts"
        )


def _plain_problem(value: Any, where: str) -> str | None:
    """Where ``value`` holds something ``torch.load(weights_only=True)`` rejects, or None."""
    if isinstance(value, np.generic):
        # np.float64 subclasses float, yet is pickled as a NumPy object.
        return f"a NumPy scalar ({type(value).__name__}) at {where}"
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            problem = _plain_problem(item, f"{where}[{index}]")
            if problem is not None:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"a non-string key {key!r} in {where}"
            problem = _plain_problem(item, f"{where}[{key!r}]")
            if problem is not None:
                return problem
        return None
    return f"a {type(value).__module__}.{type(value).__qualname__} at {where}"
