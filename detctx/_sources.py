"""RNG sources: one small protocol, one registry.

Python's ``random``, NumPy's global generator and torch's CPU generator are
registered here like any user source. Accelerators (CUDA, NPU, ...) are sources
too; they are discovered in :mod:`detctx._accelerators`.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from detctx._accelerators import is_accelerator_name
from detctx._numpy_restore import restore_random_state

__all__ = [
    "RNGSource",
    "register_source",
    "registered_sources",
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
    """

    def capture(self) -> Any: ...

    def restore(self, state: Any) -> None: ...

    def seed(self, seed: int) -> None: ...


class PythonRandomSource:
    """A ``random.Random`` instance; by default the ``random`` module's own."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng: Any = rng if rng is not None else random

    def capture(self) -> Any:
        return self._rng.getstate()

    def restore(self, state: Any) -> None:
        self._rng.setstate(state)

    def seed(self, seed: int) -> None:
        self._rng.seed(seed)


class NumpyRandomStateSource:
    """A legacy ``np.random.RandomState``; by default NumPy's global one.

    The global one is looked up on first use: ``import numpy`` does not load
    ``numpy.random``, and importing detctx should not either.
    """

    def __init__(self, rng: np.random.RandomState | None = None) -> None:
        self._rng = rng

    def _target(self) -> np.random.RandomState:
        if self._rng is None:
            # np.random.seed/get_state/set_state are this object's bound methods.
            self._rng = np.random.mtrand._rand
        return self._rng

    @property
    def bit_generator(self) -> np.random.BitGenerator:
        """The bit generator under the ``RandomState``."""
        bit_generator: np.random.BitGenerator = self._target()._bit_generator
        return bit_generator

    def capture(self) -> Any:
        rng = self._target()
        # The legacy tuple exists for MT19937 only; asking it of another bit
        # generator warns (RuntimeWarning) and returns the dict anyway.
        if isinstance(rng._bit_generator, np.random.MT19937):
            return rng.get_state()
        return rng.get_state(legacy=False)

    def restore(self, state: Any) -> None:
        restore_random_state(self._target(), state)

    def seed(self, seed: int) -> None:
        self._target().seed(seed)


class NumpyGeneratorSource:
    """A ``np.random.Generator``; seeding gives the stream of ``default_rng``-style
    construction with the same bit generator type (``type(bg)(seed)``)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._bit_generator = rng.bit_generator

    @property
    def bit_generator(self) -> np.random.BitGenerator:
        """The ``Generator``'s bit generator."""
        return self._bit_generator

    def capture(self) -> Any:
        return self._bit_generator.state

    def restore(self, state: Any) -> None:
        self._bit_generator.state = state

    def seed(self, seed: int) -> None:
        self._bit_generator.state = type(self._bit_generator)(seed).state


class TorchGeneratorSource:
    """A ``torch.Generator`` on the CPU; by default ``torch.default_generator``.

    Seeding the default generator here, rather than through
    ``torch.manual_seed``, avoids queueing lazy seeds (with a formatted stack
    trace each) for accelerators that are not present; accelerators are seeded
    by their own sources.
    """

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


_OPTIONAL_METHODS = ("validate_state", "state_to_plain", "state_from_plain")
_ARGUMENTS = {
    "capture": (),
    "restore": ("state",),
    "seed": ("seed",),
    "validate_state": ("state",),
    "state_to_plain": ("state",),
    "state_from_plain": ("plain",),
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
