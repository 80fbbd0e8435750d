"""RNG sources: one small protocol, one registry.

Python's ``random``, NumPy's global generator and torch's CPU generator are
registered here like any user source. Accelerators (CUDA, NPU, ...) are sources
too; they are discovered in :mod:`detctx._sources.accelerators`.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

import detctx._sources.checks as checks
import detctx._sources.plain as plain
from detctx._sources.accelerators import is_accelerator_name
from detctx._sources.generator_states import StateRows, cpu_generator_states
from detctx._sources.numpy_sources import NumpyGeneratorSource, NumpyRandomStateSource

__all__ = [
    "Checkpointable",
    "RNGSource",
    "Seeder",
    "register_source",
    "registered_sources",
    "seeder_of",
    "unregister_source",
]


@runtime_checkable
class RNGSource(Protocol):
    """Anything whose random state detctx can save, seed and put back.

    ``capture`` returns an opaque value that ``restore`` accepts; ``seed``
    resets the source to the stream of the given seed (an int in
    ``[0, 2**32 - 1]``). ``capture`` must not change the source's state.

    A source may also offer ``validate_state(state)``, raising ``ValueError``
    for a state it must not be given: restoring a checkpoint calls it before
    any RNG is touched.

    And ``agreement_parts(state)``, for a state that should agree only among
    some ranks: it returns ``(part, scope, value)`` triples, and
    ``verify_across_ranks`` compares each part only among the ranks that give
    it the same ``scope`` string (``""``: every rank; ``None``: no other
    rank). Without it the whole state must agree on every rank.
    """

    def capture(self) -> Any: ...

    def restore(self, state: Any) -> None: ...

    def seed(self, seed: int) -> None: ...


@runtime_checkable
class Checkpointable(Protocol):
    """A source that knows its own checkpoint form: every built-in source.

    ``to_checkpoint(state)`` gives ``(kind, plain data)``; ``from_checkpoint(kind,
    plain)`` gives back a state ``restore`` takes, after checking every value
    (raising :class:`~detctx._sources.checks.InvalidField`, ``TypeError``,
    ``KeyError`` or ``ValueError`` for one it must not be given). The kinds
    it writes and reads are ``checkpoint_kinds``. A user source converts its
    state through :class:`~detctx.PlainStateSource` instead.
    """

    @property
    def checkpoint_kinds(self) -> frozenset[str]: ...

    def to_checkpoint(self, state: Any) -> tuple[str, Any]: ...

    def from_checkpoint(self, kind: str, stored: Any) -> Any: ...


class PythonRandomSource:
    """A ``random.Random`` instance; by default the ``random`` module's own.

    Checkpoint form ``"python"``: the 625-word Mersenne Twister state as an
    int64 tensor, plus the version and the cached Gaussian.
    """

    checkpoint_kinds: ClassVar[frozenset[str]] = frozenset({"python"})

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng: Any = rng if rng is not None else random

    def capture(self) -> Any:
        return self._rng.getstate()

    def restore(self, state: Any) -> None:
        self._rng.setstate(state)

    def seed(self, seed: int) -> None:
        self._rng.seed(seed)

    def to_checkpoint(self, state: Any) -> tuple[str, Any]:
        version, internal, gauss_next = state
        return "python", {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        }

    def from_checkpoint(self, kind: str, stored: Any) -> Any:
        stored = checks.check_fields(stored, "version", "internal", "gauss_next")
        internal = plain.tensor(stored["internal"], torch.int64).numpy()
        checks.check_python(stored["version"], internal, stored["gauss_next"])
        words = tuple(int(word) for word in internal.tolist())
        return (stored["version"], words, stored["gauss_next"])


class TorchGeneratorSource:
    """A ``torch.Generator`` on the CPU; by default ``torch.default_generator``.

    Checkpoint form ``"torch"``: the generator's state tensor.

    Seeding the default generator here, rather than through
    ``torch.manual_seed``, avoids queueing lazy seeds (with a formatted stack
    trace each) for accelerators that are not present; accelerators are seeded
    by their own sources.
    """

    checkpoint_kinds: ClassVar[frozenset[str]] = frozenset({"torch"})

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self._generator = generator if generator is not None else torch.default_generator

    @property
    def device(self) -> torch.device:
        """The device of the generator."""
        return self._generator.device

    def capture(self) -> Any:
        return self._generator.get_state()

    def restore(self, state: Any) -> None:
        self._generator.set_state(state)

    def seed(self, seed: int) -> None:
        self._generator.manual_seed(seed)

    def to_checkpoint(self, state: Any) -> tuple[str, Any]:
        return "torch", state.clone()

    def from_checkpoint(self, kind: str, stored: Any) -> Any:
        state = plain.tensor(stored, torch.uint8).clone()
        checks.check_torch(state, torch.Generator(device=self.device))
        return state


class Seeder:
    """What seeds one source from 64-bit seeds in a keyed world: ``seed(s)``, every bit of
    ``s`` reaching the stream; ``prepare(seeds)`` does ahead, for a batch at once, what
    seeding those seeds needs (a loader seeds before every sample)."""

    __slots__ = ("prepare", "seed")

    def __init__(
        self,
        seed: Callable[[int], object],
        prepare: Callable[[Sequence[int]], object] | None = None,
    ) -> None:
        self.seed = seed
        self.prepare: Callable[[Sequence[int]], object] = prepare or _nothing


def _nothing(seeds: Sequence[int]) -> None:
    return None


class _TorchStates:
    """A CPU generator seeded from whole states (``manual_seed`` keeps 32 bits of a seed)."""

    __slots__ = ("_generator", "_ready", "_rows")

    def __init__(self, generator: torch.Generator) -> None:
        self._generator = generator
        self._rows = StateRows()
        self._ready: dict[int, torch.Tensor] = {}

    def prepare(self, seeds: Sequence[int]) -> None:
        states = self._rows.fill(seeds)
        self._ready = {} if states is None else dict(zip(seeds, states))

    def seed(self, seed: int) -> None:
        state = self._ready.get(seed)
        if state is None:
            states = cpu_generator_states([seed])
            if states is None:
                self._generator.manual_seed(seed)
                return
            state = states[0]
        self._generator.set_state(state)


def seeder_of(source: RNGSource) -> Seeder:
    """What seeds ``source`` from a 64-bit seed in a keyed world (an elastic loader's sample,
    a keyed collator's batch), each built-in source by every bit of it: Python's ``random``
    by its own seeding (all words of an int), NumPy's ``RandomState`` by its two 32-bit
    words, a ``Generator`` through ``SeedSequence``, a CPU ``torch.Generator`` from a whole
    state, a device one by ``manual_seed`` (Philox keeps 64 bits). A source of your own is
    seeded through its protocol, with 32 bits: the seed's high half."""
    # Exact types: a subclass may seed otherwise, through its own seed method.
    if type(source) is TorchGeneratorSource:
        generator = source._generator
        if generator.device.type != "cpu":
            return Seeder(generator.manual_seed)
        states = _TorchStates(generator)
        return Seeder(states.seed, states.prepare)
    if type(source) is PythonRandomSource:
        return Seeder(source._rng.seed)
    if type(source) is NumpyRandomStateSource:
        return Seeder(source.seed_words)
    if type(source) is NumpyGeneratorSource:
        return Seeder(source.seed)
    return Seeder(lambda seed: source.seed(seed >> 32))


def as_source(obj: object) -> RNGSource:
    """Adapt ``obj`` to the :class:`RNGSource` protocol, or raise ``TypeError``."""
    if isinstance(obj, torch.Generator):
        return TorchGeneratorSource(obj)
    if isinstance(obj, random.Random):
        return PythonRandomSource(obj)
    if isinstance(obj, np.random.RandomState):
        return NumpyRandomStateSource(obj)
    if isinstance(obj, np.random.Generator):
        return NumpyGeneratorSource(obj)
    if isinstance(obj, type):
        raise TypeError(
            f"cannot manage the class {obj.__qualname__!r} as an RNG source: register an "
            f"instance of it, e.g. register_source(name, {obj.__qualname__}())"
        )
    if isinstance(obj, RNGSource):
        _check_protocol(obj)
        return obj
    raise TypeError(
        f"cannot manage {type(obj).__name__!r} as an RNG source: pass a torch.Generator, "
        "random.Random, numpy RandomState or Generator, or an object with "
        "capture(), restore(state) and seed(seed) methods"
    )


_OPTIONAL_METHODS = ("validate_state", "state_to_plain", "state_from_plain", "agreement_parts")
_ARGUMENTS = {
    "capture": (),
    "restore": ("state",),
    "seed": ("seed",),
    "validate_state": ("state",),
    "state_to_plain": ("state",),
    "state_from_plain": ("plain",),
    "agreement_parts": ("state",),
}
"""The positional arguments detctx calls each protocol method with."""


def _check_protocol(obj: object) -> None:
    """Refuse a source whose protocol methods exist but cannot be called as detctx calls them."""
    required = [name for name in ("capture", "restore", "seed") if not callable(getattr(obj, name))]
    optional = [
        name
        for name in _OPTIONAL_METHODS
        if hasattr(obj, name) and not callable(getattr(obj, name))
    ]
    if required or optional:
        raise TypeError(
            f"cannot manage {type(obj).__name__!r} as an RNG source: "
            f"{', '.join(required + optional)} must be method(s), not "
            f"{', '.join(type(getattr(obj, name)).__name__ for name in required + optional)}; "
            "an RNG source needs callable capture(), restore(state) and seed(seed)"
        )
    for name, arguments in _ARGUMENTS.items():
        method = getattr(obj, name, None)
        if method is None:
            continue
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):  # a builtin or C method without a readable signature
            continue
        try:
            signature.bind(*arguments)
        except TypeError:
            called = f"{name}({', '.join(arguments)})"
            bare = signature.replace(
                parameters=[
                    parameter.replace(annotation=inspect.Parameter.empty)
                    for parameter in signature.parameters.values()
                ],
                return_annotation=inspect.Signature.empty,
            )
            raise TypeError(
                f"cannot manage {type(obj).__name__!r} as an RNG source: detctx calls "
                f"{called}, but {name} takes {bare}; an RNG source needs capture(), "
                "restore(state) and seed(seed)"
            ) from None


_BUILTIN: dict[str, RNGSource] = {
    "python": PythonRandomSource(),
    "numpy": NumpyRandomStateSource(),
    "torch": TorchGeneratorSource(),
}
_registry: dict[str, RNGSource] = dict(_BUILTIN)
_version = 0


def registry_version() -> int:
    """A number that changes whenever a source is registered or unregistered."""
    return _version


def register_source(name: str, source: object) -> None:
    """Manage ``source`` in every ``deterministic`` block and snapshot from now on.

    ``source`` is a ``torch.Generator`` (a sampler's, say), a ``random.Random``,
    a NumPy ``RandomState`` or ``Generator``, or any object implementing
    :class:`RNGSource`. It is seeded with the block's seed, saved on entry and
    restored on exit. Names are unique: registering a taken name raises
    ``ValueError`` (unregister it first). A class rather than an instance,
    or an object whose ``capture``, ``restore`` or ``seed`` (or
    ``validate_state``, ``state_to_plain``, ``state_from_plain``, where
    present) is not callable or does not take the arguments detctx passes
    (none for ``capture``, one for the others), raises ``TypeError`` here,
    naming the method, and nothing is registered::

        detctx.register_source("sampler", torch.Generator())
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"source name must be a non-empty string, got {name!r}")
    adapted = as_source(source)
    if name in _registry or is_accelerator_name(name):
        raise ValueError(f"an RNG source named {name!r} is already registered")
    global _version
    _registry[name] = adapted
    _version += 1


def unregister_source(name: str) -> None:
    """Stop managing the source registered as ``name``. Built-in sources stay."""
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in source and cannot be unregistered")
    global _version
    try:
        del _registry[name]
    except KeyError:
        raise KeyError(f"no RNG source named {name!r} is registered") from None
    _version += 1


def registered_sources() -> Iterator[tuple[str, RNGSource]]:
    """The registered (non-accelerator) sources, built-ins first."""
    return iter(list(_registry.items()))
